"""Conversations and their items (deployments/state/conversations.py)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 14:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
    )
    op.create_table(
        "conversation_items",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("conversation_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("item", sa.JSON(), nullable=False),
        sa.Column("message", sa.JSON(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
    )
    op.create_index("ix_conversations_id", "conversations", ["id"], unique=True)
    op.create_index("ix_conversations_owner", "conversations", ["owner"], unique=False)
    op.create_index("ix_conversation_items_id", "conversation_items", ["id"], unique=True)
    op.create_index(
        "ix_conversation_items_conversation_id",
        "conversation_items",
        ["conversation_id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_table("conversation_items")
    op.drop_table("conversations")
