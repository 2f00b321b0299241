"""The first schema: assistants, threads, messages, runs, run steps, idempotency keys

Revision ID: 0001
Revises:
Create Date: 2026-11-23 18:10:08.572404
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "assistants",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("top_p", sa.Float(), nullable=True),
        sa.Column("response_format", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("assistants", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_assistants_id"), ["id"], unique=True)

    op.create_table(
        "idempotency_keys",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("scope", sa.String(length=128), nullable=False),
        sa.Column("key", sa.String(length=256), nullable=False),
        sa.Column("object_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("scope", "key"),
    )
    op.create_table(
        "messages",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("thread_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("assistant_id", sa.String(length=64), nullable=True),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("completed_at", sa.Integer(), nullable=True),
        sa.Column("incomplete_at", sa.Integer(), nullable=True),
        sa.Column("incomplete_details", sa.JSON(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_messages_id"), ["id"], unique=True)
        batch_op.create_index(batch_op.f("ix_messages_thread_id"), ["thread_id"], unique=False)

    op.create_table(
        "run_steps",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("thread_id", sa.String(length=64), nullable=False),
        sa.Column("assistant_id", sa.String(length=64), nullable=False),
        sa.Column("message_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("completed_at", sa.Integer(), nullable=True),
        sa.Column("cancelled_at", sa.Integer(), nullable=True),
        sa.Column("failed_at", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.JSON(), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("run_steps", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_steps_id"), ["id"], unique=True)
        batch_op.create_index(batch_op.f("ix_run_steps_run_id"), ["run_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_run_steps_thread_id"), ["thread_id"], unique=False)

    op.create_table(
        "runs",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("thread_id", sa.String(length=64), nullable=False),
        sa.Column("assistant_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=True),
        sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("top_p", sa.Float(), nullable=True),
        sa.Column("max_prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("max_completion_tokens", sa.Integer(), nullable=True),
        sa.Column("response_format", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.Integer(), nullable=True),
        sa.Column("completed_at", sa.Integer(), nullable=True),
        sa.Column("cancelled_at", sa.Integer(), nullable=True),
        sa.Column("failed_at", sa.Integer(), nullable=True),
        sa.Column("expires_at", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.JSON(), nullable=True),
        sa.Column("incomplete_details", sa.JSON(), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("leased_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_id"), ["id"], unique=True)
        batch_op.create_index(batch_op.f("ix_runs_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_thread_id"), ["thread_id"], unique=False)
        batch_op.create_index(
            "one_active_run_per_thread",
            ["thread_id"],
            unique=True,
            sqlite_where=sa.text("status IN ('queued', 'in_progress', 'cancelling')"),
            postgresql_where=sa.text("status IN ('queued', 'in_progress', 'cancelling')"),
        )

    op.create_table(
        "threads",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("threads", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_threads_id"), ["id"], unique=True)


def downgrade() -> None:

    with op.batch_alter_table("threads", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_threads_id"))

    op.drop_table("threads")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_thread_id"))
        batch_op.drop_index(batch_op.f("ix_runs_status"))
        batch_op.drop_index(batch_op.f("ix_runs_id"))

    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("one_active_run_per_thread")
    op.drop_table("runs")
    with op.batch_alter_table("run_steps", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_steps_thread_id"))
        batch_op.drop_index(batch_op.f("ix_run_steps_run_id"))
        batch_op.drop_index(batch_op.f("ix_run_steps_id"))

    op.drop_table("run_steps")
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_messages_thread_id"))
        batch_op.drop_index(batch_op.f("ix_messages_id"))

    op.drop_table("messages")
    op.drop_table("idempotency_keys")
    with op.batch_alter_table("assistants", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_assistants_id"))

    op.drop_table("assistants")
