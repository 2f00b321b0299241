"""The aliases started at run time, one row each, in the app's database: a restarted
operator finds the Serve applications it had started and serves them again, rather than
forgetting them while they hold their resources."""

from typing import Any

from sqlalchemy import JSON, Integer, String, Text, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from deployments.config import ModelDeploymentConfig
from deployments.operator.inference import WingmanItem
from deployments.state.base import Base
from deployments.state.database import Database


class InferenceRow(Base):
    __tablename__ = "inference_items"

    app: Mapped[str] = mapped_column(String(128), primary_key=True)
    alias: Mapped[str] = mapped_column(String(128), primary_key=True)
    model_repo: Mapped[str] = mapped_column(String(200))
    file_path: Mapped[str] = mapped_column(String(512))
    context_size: Mapped[int] = mapped_column(Integer)
    gpu_layers: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    error: Mapped[str] = mapped_column(Text)
    config: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created: Mapped[int] = mapped_column(Integer)
    updated: Mapped[int] = mapped_column(Integer)


_FIELDS = ["alias", "model_repo", "file_path", "context_size", "gpu_layers", "status", "error",
           "created", "updated"]  # fmt: skip


class InferenceStore:
    """Rows are the Serve application's: two apps sharing a database keep their own."""

    def __init__(self, db: Database, app: str) -> None:
        self.db, self.app = db, app

    def all(self) -> list[WingmanItem]:
        with Session(self.db.engine) as session:
            mine = select(InferenceRow).filter_by(app=self.app).order_by(InferenceRow.created)
            items = []
            for r in session.scalars(mine).all():
                item = WingmanItem(**{f: getattr(r, f) for f in _FIELDS})
                try:
                    if r.config is not None:
                        item.config = ModelDeploymentConfig.model_validate(r.config)
                except ValueError as exc:  # a row an older release wrote: shown, not served
                    item.status, item.error = "error", f"stored config unreadable: {exc}"
                items.append(item)
            return items

    def save(self, item: WingmanItem) -> None:
        config = item.config.model_dump(mode="json") if item.config is not None else None
        with Session(self.db.engine) as session, session.begin():
            fields = {f: getattr(item, f) for f in _FIELDS}
            session.merge(InferenceRow(app=self.app, config=config, **fields))

    def delete(self, alias: str) -> None:
        with Session(self.db.engine) as session, session.begin():
            row = session.get(InferenceRow, (self.app, alias))
            if row is not None:
                session.delete(row)
