"""The LoRA adapters loaded at run time, one row each, in the operator's database: a
restarted operator (and every ingress replica, which follows it) still knows them."""

from sqlalchemy import BigInteger, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from deployments.state.base import Base, now
from deployments.state.database import Database


class LoraAdapterRow(Base):
    __tablename__ = "lora_adapters"

    app: Mapped[str] = mapped_column(String(128), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))
    path: Mapped[str] = mapped_column(String(1024))
    version: Mapped[int] = mapped_column(BigInteger)  # the load's, in its adapter_id
    created: Mapped[int] = mapped_column(Integer)


class LoraAdapterStore:
    """Rows are the Serve application's; a name is unique in an app (a request may name
    an adapter alone)."""

    def __init__(self, db: Database, app: str) -> None:
        self.db, self.app = db, app

    def all(self) -> dict[str, dict[str, tuple[str, int]]]:
        """model -> adapter -> (directory, load version)."""
        with Session(self.db.engine) as session:
            rows = session.scalars(
                select(LoraAdapterRow).filter_by(app=self.app).order_by(LoraAdapterRow.created)
            )
            found: dict[str, dict[str, str]] = {}
            for row in rows:
                found.setdefault(row.model, {})[row.name] = (row.path, row.version)
            return found

    def get(self, name: str) -> tuple[str, str] | None:
        """(model, directory) of adapter `name`."""
        with Session(self.db.engine) as session:
            row = session.get(LoraAdapterRow, (self.app, name))
            return None if row is None else (row.model, row.path)

    def save(self, model: str, name: str, path: str, version: int) -> None:
        with Session(self.db.engine) as session, session.begin():
            fields = dict(model=model, path=path, version=version, created=now())
            session.merge(LoraAdapterRow(app=self.app, name=name, **fields))

    def delete(self, name: str) -> bool:
        with Session(self.db.engine) as session, session.begin():
            row = session.get(LoraAdapterRow, (self.app, name))
            if row is not None:
                session.delete(row)
            return row is not None
