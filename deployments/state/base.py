"""What every table of the app's database shares: the declarative base, ids and clocks,
and the Idempotency-Key record that any POST of the app may use."""

import secrets
import time

from sqlalchemy import Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


class Base(DeclarativeBase):
    pass


class IdempotencyKey(Base):
    """A POST's Idempotency-Key and the object it created: a retry gets that object."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("scope", "key"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    scope: Mapped[str] = mapped_column(String(128))  # the route and its parent's id
    key: Mapped[str] = mapped_column(String(256))
    object_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(Integer, default=now)
