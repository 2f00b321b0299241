"""What the Assistants routes share: the store and the run executor of this ingress,
made at start-up (the schema migrated then) and found on the app's state, and the
ingress's Retrieval (deployments/retrieval), looked up when needed: the vector stores'
dialect makes it after this one, and it is None when files or embeddings are off."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from app.protocol.errors import NotFoundError
from deployments.api.assistants.runs import RunExecutor
from deployments.api.assistants.store import AssistantsStore
from deployments.http.caller import Caller, caller_of
from deployments.ingress import Ingress
from deployments.retrieval.service import Retrieval

logger = logging.getLogger("ray.serve")


@dataclass
class Assistants:
    store: AssistantsStore
    runs: RunExecutor
    retrieval: Callable[[], Retrieval | None]


def install(app: FastAPI, ingress: Ingress) -> None:
    config = ingress.config.assistants
    if not config.enabled:
        return
    store = AssistantsStore(ingress.config.database.sqlalchemy_url(), config.run_lease_s)
    retrieval = lambda: getattr(app.state, "retrieval", None)  # noqa: E731
    runs = RunExecutor(ingress, store, retrieval)
    assistants = app.state.assistants = Assistants(store, runs, retrieval)
    logger.info("assistants database ready (%s)", store.db.engine.url.render_as_string())

    async def stop() -> None:  # Serve runs the app's shutdown when the replica stops
        await assistants.runs.shutdown()
        store.close()

    app.router.on_shutdown.append(stop)


def assistants_of(request: Request) -> Assistants:
    assistants = getattr(request.app.state, "assistants", None)
    if assistants is None:
        raise NotFoundError("the Assistants API is turned off on this server")
    return assistants


AssistantsDep = Annotated[Assistants, Depends(assistants_of)]
# Who asks: a key sees only the assistants and threads it made (an admin key all).
WhoDep = Annotated[Caller, Depends(caller_of)]
