"""Alembic's environment for the app's database: run at start-up (`alembic upgrade head`,
see database.py) on the URL it was given. Every feature's tables are imported so that
the metadata is the whole database's."""

from alembic import context
from sqlalchemy import create_engine

from deployments.state import (  # noqa: F401 (tables)
    assistants,
    conversations,
    downloads,
    files,
    inference,
    lora_adapters,
    responses,
)
from deployments.state.base import Base

config = context.config
connection = config.attributes.get("connection")


def run(conn) -> None:  # noqa: ANN001
    context.configure(
        connection=conn,
        target_metadata=Base.metadata,
        render_as_batch=conn.dialect.name == "sqlite",  # SQLite alters tables by copying
    )
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    run(connection)
else:
    with create_engine(config.get_main_option("sqlalchemy.url")).connect() as conn:
        run(conn)
