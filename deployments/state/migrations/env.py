"""Alembic's environment for the Assistants database: run by AssistantsStore at start-up
(`alembic upgrade head`), on the URL the store was given."""

from alembic import context
from sqlalchemy import create_engine

from deployments.assistants.schema import Base

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
