"""The migrations make exactly the tables the models say: alembic's autogenerate finds
nothing to change on a database migrated from empty."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from deployments.state import (  # noqa: F401 (every feature's tables, as migrations/env.py)
    assistants,
    conversations,
    downloads,
    files,
    inference,
    responses,
)
from deployments.state.base import Base
from deployments.state.database import Database


def test_models_match_migrations(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'schema.sqlite3'}")
    try:
        with db.engine.connect() as conn:
            diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        db.close()
    assert diffs == []
