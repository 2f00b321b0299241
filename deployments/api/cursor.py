"""OpenAI's cursor pagination as query parameters (`limit`, `order`, `after`, `before`),
which every list route of the app's stored objects takes (deployments/state/database.py,
`page`)."""

from typing import Annotated, Literal

from fastapi import Depends, Query


class Cursor:
    def __init__(
        self,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        before: str | None = None,
    ) -> None:
        self.args = {"limit": limit, "order": order, "after": after, "before": before}


CursorDep = Annotated[Cursor, Depends()]
