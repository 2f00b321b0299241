"""A thread kept warm: each Assistants thread is a persistent context
(deployments/warm_context.py), named after the thread."""

from app.protocol.sampling import SamplingParams
from deployments.generation import Generation
from deployments.ingress import Ingress
from deployments.warm_context import free, generate_in_context


def context_id(thread_id: str) -> str:
    return f"assistants/{thread_id}"


async def generate_in_thread(
    ingress: Ingress,
    model: str,
    thread_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    tag: str,
) -> tuple[Generation, int]:
    """Start the run's generation in the thread's context; also returns how many of the
    prompt's tokens the context already held (0: rebuilt)."""
    return await generate_in_context(ingress, model, context_id(thread_id), prompt_ids, params, tag)


async def free_thread(ingress: Ingress, model: str, thread_id: str) -> None:
    """Drop the thread's context, where there is one (a deleted thread)."""
    await free(ingress, model, context_id(thread_id))
