"""Files, vector stores, their files, file batches and chunks (deployments/state/files.py)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28 12:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _ids() -> list:
    return [
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(length=64), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "files",
        *_ids(),
        sa.Column("owner", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("media_type", sa.String(length=128), nullable=False),
        sa.Column("expires_at", sa.Integer(), nullable=True),
    )
    op.create_table(
        "vector_stores",
        *_ids(),
        sa.Column("owner", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("expires_after", sa.JSON(), nullable=True),
        sa.Column("expires_at", sa.Integer(), nullable=True),
        sa.Column("last_active_at", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    op.create_table(
        "vector_store_files",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("store_id", sa.String(length=64), nullable=False),
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("last_error", sa.JSON(), nullable=True),
        sa.Column("chunking", sa.JSON(), nullable=False),
        sa.Column("attributes", sa.JSON(), nullable=True),
        sa.Column("usage_bytes", sa.Integer(), nullable=False),
        sa.Column("leased_at", sa.Float(), nullable=False),
        sa.UniqueConstraint("store_id", "file_id"),
    )
    op.create_table(
        "vector_store_file_batches",
        *_ids(),
        sa.Column("store_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("cancelled", sa.Integer(), nullable=False),
    )
    op.create_table(
        "chunks",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("store_id", sa.String(length=64), nullable=False),
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("embedding", sa.LargeBinary(), nullable=False),
    )
    for table, columns in INDEXES:
        op.create_index(f"ix_{table}_{'_'.join(columns)}", table, list(columns), unique=False)
    if op.get_bind().dialect.name == "postgresql":
        # The chunks' words for full-text ranking (deployments/retrieval/lexical.py),
        # computed once when a chunk is written and indexed, not per query.
        op.execute(
            "ALTER TABLE chunks ADD COLUMN terms tsvector "
            "GENERATED ALWAYS AS (to_tsvector('english', text)) STORED"
        )
        op.execute("CREATE INDEX ix_chunks_terms ON chunks USING gin (terms)")
    op.create_index("ix_files_id", "files", ["id"], unique=True)
    op.create_index("ix_vector_stores_id", "vector_stores", ["id"], unique=True)
    op.create_index(
        "ix_vector_store_file_batches_id", "vector_store_file_batches", ["id"], unique=True
    )


INDEXES = (
    ("files", ("owner",)),
    ("vector_stores", ("owner",)),
    ("vector_store_files", ("store_id",)),
    ("vector_store_files", ("file_id",)),
    ("vector_store_files", ("batch_id",)),
    ("vector_store_files", ("status",)),
    ("vector_store_file_batches", ("store_id",)),
    ("chunks", ("store_id", "file_id")),
)


def downgrade() -> None:
    for table in ("chunks", "vector_store_file_batches", "vector_store_files"):
        op.drop_table(table)
    op.drop_table("vector_stores")
    op.drop_table("files")
