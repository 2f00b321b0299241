"""The LoRA adapters loaded at run time (deployments/state/lora_adapters.py)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30 03:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("app", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("created", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("app", "name"),
    )


def downgrade() -> None:
    op.drop_table("lora_adapters")
