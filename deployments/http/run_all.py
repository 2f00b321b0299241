"""Several generations for one HTTP request (a list of prompts), run together."""

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from deployments.http.generation import Generation

IN_FLIGHT = 8  # of one request's prompts, generating at once


async def run_all(
    starts: Sequence[Callable[[str], Awaitable[Generation]]], tag: str
) -> list[Generation]:
    """Start each generation (`start(tag)`, tag suffixed with its index) and drain them
    all: at most IN_FLIGHT at once, so that one request cannot take a replica's every
    seat. They are started one after another: Serve gives every handle call made while
    serving one HTTP request that request's internal id, and its router cannot tell two
    such calls apart while both wait to be routed; a started one has been routed. If
    one fails, the others are cancelled and its error is the answer."""
    gens: list[Generation] = []
    seats = asyncio.Semaphore(IN_FLIGHT)

    async def drain(gen: Generation) -> None:
        try:
            await gen.drain()
        finally:
            seats.release()

    try:
        async with asyncio.TaskGroup() as group:
            for i, start in enumerate(starts):
                await seats.acquire()
                gen = await start(f"{tag}.{i}")
                gens.append(gen)
                group.create_task(drain(gen))
    except BaseException as failed:
        for gen in gens:  # a drain cancelled before it first ran cannot cancel its own
            gen.cancel()
        if isinstance(failed, BaseExceptionGroup):
            raise failed.exceptions[0] from None
        raise
    return gens
