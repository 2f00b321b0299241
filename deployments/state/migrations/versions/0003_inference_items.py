"""The operator's aliases started at run time (deployments/state/inference.py)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 21:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "inference_items",
        sa.Column("app", sa.String(length=128), nullable=False),
        sa.Column("alias", sa.String(length=128), nullable=False),
        sa.Column("model_repo", sa.String(length=200), nullable=False),
        sa.Column("file_path", sa.String(length=512), nullable=False),
        sa.Column("context_size", sa.Integer(), nullable=False),
        sa.Column("gpu_layers", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=True),
        sa.Column("created", sa.Integer(), nullable=False),
        sa.Column("updated", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("app", "alias"),
    )


def downgrade() -> None:
    op.drop_table("inference_items")
