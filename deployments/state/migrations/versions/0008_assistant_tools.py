"""Tools in Assistants runs: function tools (requires_action) and file_search

The new columns are nullable: rows made before have none (deployments/state/
assistants.py reads a missing one as its default). A run in `requires_action` counts as
active, so the partial unique index "one active run per thread" is made again with it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 18:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

ACTIVE = "status IN ('queued', 'in_progress', 'requires_action', 'cancelling')"
ACTIVE_BEFORE = "status IN ('queued', 'in_progress', 'cancelling')"
COLUMNS = {
    "assistants": [("tools", sa.JSON()), ("tool_resources", sa.JSON())],
    "threads": [("tool_resources", sa.JSON())],
    "messages": [
        ("attachments", sa.JSON()),
        ("annotations", sa.JSON()),
        ("excerpts", sa.JSON()),
        ("prelude", sa.JSON()),
    ],
    "runs": [
        ("tools", sa.JSON()),
        ("tool_choice", sa.JSON()),
        ("parallel_tool_calls", sa.Boolean()),
        ("required_action", sa.JSON()),
        ("tool_turns", sa.JSON()),
        ("vector_store_ids", sa.JSON()),
    ],
    "run_steps": [
        ("type", sa.String(length=16)),
        ("tool_calls", sa.JSON()),
        ("expired_at", sa.Integer()),
    ],
}


def _active_index(where: str) -> None:
    op.create_index(
        "one_active_run_per_thread",
        "runs",
        ["thread_id"],
        unique=True,
        sqlite_where=sa.text(where),
        postgresql_where=sa.text(where),
    )


def upgrade() -> None:
    for table, columns in COLUMNS.items():
        for name, kind in columns:
            op.add_column(table, sa.Column(name, kind, nullable=True))
    # A tool_calls step makes no message. SQLite changes a column by a copy of the table.
    with op.batch_alter_table("run_steps") as batch:
        batch.alter_column("message_id", existing_type=sa.String(length=64), nullable=True)
    op.drop_index("one_active_run_per_thread", table_name="runs")
    _active_index(ACTIVE)


def downgrade() -> None:
    op.drop_index("one_active_run_per_thread", table_name="runs")
    _active_index(ACTIVE_BEFORE)
    op.execute("DELETE FROM run_steps WHERE message_id IS NULL")
    with op.batch_alter_table("run_steps") as batch:
        batch.alter_column("message_id", existing_type=sa.String(length=64), nullable=False)
    for table, columns in COLUMNS.items():
        with op.batch_alter_table(table) as batch:  # SQLite drops a column by a copy
            for name, _ in columns:
                batch.drop_column(name)
