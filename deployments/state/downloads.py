"""The download list, one row per (modelRepo, filePath), in the app's database (the one
the Assistants API uses), so a restart reports what was downloaded and resumes the rest.
An empty filePath stands for every file of the repo. Rows are the Serve application's:
two apps sharing a database keep their own lists."""

import json
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Integer, String, Text, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from deployments.state.base import Base
from deployments.state.database import Database

# queued -> downloading -> complete | error | cancelled; cancelled and error may restart.
ACTIVE = ("queued", "downloading")


class Download(Base):
    __tablename__ = "downloads"

    app: Mapped[str] = mapped_column(String(128), primary_key=True)
    model_repo: Mapped[str] = mapped_column(String(200), primary_key=True)
    file_path: Mapped[str] = mapped_column(String(512), primary_key=True)
    status: Mapped[str] = mapped_column(String(16))
    commit: Mapped[str | None] = mapped_column(String(64))
    total_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    downloaded_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    location: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    created: Mapped[int] = mapped_column(Integer)
    updated: Mapped[int] = mapped_column(Integer)


@dataclass
class DownloadState:
    """A row's values as the manager changes them (no session needed)."""

    model_repo: str
    file_path: str
    status: str
    commit: str | None = None
    total_bytes: int = 0
    downloaded_bytes: int = 0
    location: str | None = None
    error: str | None = None
    created: int = 0
    updated: int = 0

    def as_api(self, speed_bps: float = 0.0) -> dict[str, Any]:
        total = self.total_bytes
        return {
            "isa": "DownloadItem",
            "modelRepo": self.model_repo,
            "filePath": self.file_path,
            "status": self.status,
            "totalBytes": total,
            "downloadedBytes": self.downloaded_bytes,
            "downloadSpeed": f"{speed_bps / 1e6:.2f} MB/s",
            "progress": round(self.downloaded_bytes / total, 4) if total else 0.0,
            "metadata": json.dumps({"commit": self.commit, "location": self.location}),
            "error": self.error or "",
            "created": self.created,
            "updated": self.updated,
        }


_FIELDS = [f for f in DownloadState.__dataclass_fields__]


class DownloadStore:
    def __init__(self, db: Database, app: str) -> None:
        self.db, self.app = db, app

    def all(self) -> list[DownloadState]:
        with Session(self.db.engine) as session:
            mine = select(Download).filter_by(app=self.app).order_by(Download.created)
            rows = session.scalars(mine).all()
            return [DownloadState(**{f: getattr(r, f) for f in _FIELDS}) for r in rows]

    def save(self, state: DownloadState) -> None:
        state.updated = int(time.time())
        with Session(self.db.engine) as session, session.begin():
            session.merge(Download(app=self.app, **{f: getattr(state, f) for f in _FIELDS}))

    def delete(self, model_repo: str, file_path: str) -> None:
        with Session(self.db.engine) as session, session.begin():
            row = session.get(Download, (self.app, model_repo, file_path))
            if row is not None:
                session.delete(row)
