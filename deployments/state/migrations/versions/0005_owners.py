"""Owners of assistants, threads and stored responses (the id of the key that made them)

Rows made before have no owner: only an admin key or a server without keys sees them
(deployments/state/assistants.py, OWNERS).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28 05:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TABLES = ("assistants", "threads", "responses")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("owner", sa.String(length=64), nullable=True))
    op.create_index("ix_assistants_owner", "assistants", ["owner"])
    op.create_index("ix_threads_owner", "threads", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_threads_owner", table_name="threads")
    op.drop_index("ix_assistants_owner", table_name="assistants")
    for table in TABLES:
        with op.batch_alter_table(table) as batch:  # SQLite drops a column by a copy
            batch.drop_column("owner")
