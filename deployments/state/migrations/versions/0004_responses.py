"""Stored Responses (deployments/state/responses.py)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27 19:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("chain", sa.String(length=64), nullable=False),
        sa.Column("previous_id", sa.String(length=64), nullable=True),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_responses_chain", "responses", ["chain"])
    op.create_index("ix_responses_created_at", "responses", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_created_at", table_name="responses")
    op.drop_index("ix_responses_chain", table_name="responses")
    op.drop_table("responses")
