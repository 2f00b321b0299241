"""The app's one database setting (`database` in AppConfig): where stored Responses,
Assistants and the operator's state live. Its own file so that config.py stays a page."""

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_DATABASE = "~/.shoal/assistants.sqlite3"  # the file Assistants used before: kept


class DatabaseConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str | None = Field(
        None,
        description="Any SQLAlchemy URL (e.g. postgresql+psycopg://...), which several ingress "
        "replicas may share; None: the SQLite file at `path`.",
    )
    path: str = Field(
        default_factory=lambda: os.environ.get("SHOAL_ASSISTANTS_DB", DEFAULT_DATABASE),
        description="The SQLite file when `url` is None (default: $SHOAL_ASSISTANTS_DB, else "
        "~/.shoal/assistants.sqlite3).",
    )

    def sqlalchemy_url(self) -> str:
        if self.url:
            return self.url
        path = Path(self.path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"


OPERATOR_STATE = ".shoal-operator/state.sqlite3"  # under models_dir: no repo id starts with "."


def operator_state_url(database: DatabaseConfig, models_dir: str, state_path: str | None) -> str:
    """Where the Operator keeps its own state (the download list, the models started at
    run time): the app's database when it is a server's (`database.url`, which every node
    reaches), else a SQLite file of its own, `state_path` or beside its downloads in
    models_dir. Not the app's SQLite file: that one is the ingress's, on the ingress's
    node, and a read-only home (KubeRay) or Assistants turned off must not stop the
    operator; models_dir is the one place the operator must be able to write anyway, and
    storage every node mounts, so the list moves with the files it describes."""
    if database.url:
        return database.url
    path = Path(state_path or Path(models_dir) / OPERATOR_STATE).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def moved_database_keys(data: Any) -> Any:
    """`assistants.database_url` and `assistants.database_path`, the older spelling of
    `database.url` and `database.path` (from when Assistants alone had a database), are
    taken as those; naming both spellings is refused."""
    if not isinstance(data, dict) or not isinstance(data.get("assistants"), dict):
        return data
    assistants = dict(data["assistants"])
    old = {
        k: assistants.pop(f"database_{k}") for k in ("url", "path") if f"database_{k}" in assistants
    }
    if not old:
        return data
    if data.get("database"):
        raise ValueError("set the database once: `database`, not `assistants.database_*` too")
    return {**data, "assistants": assistants, "database": old}
