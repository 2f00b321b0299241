"""A thread kept warm: each Assistants thread is a persistent context
(deployments/api/warm_context.py), named after the thread."""

from app.protocol.sampling import SamplingParams
from app.text.reasoning import ReasoningFormat
from deployments.api.warm_context import free, generate_in_context
from deployments.http.generation import Generation
from deployments.ingress import Ingress


def context_id(thread_id: str) -> str:
    return f"assistants/{thread_id}"


async def generate_in_thread(
    ingress: Ingress,
    model: str,
    thread_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    tag: str,
    reasoning: ReasoningFormat | None = None,
) -> tuple[Generation, int]:
    """Start the run's generation in the thread's context; also returns how many of the
    prompt's tokens the context already held (0: rebuilt). `reasoning`: how a reasoning
    model's thinking splits off the reply (as for Ingress.generate)."""
    cid = context_id(thread_id)
    return await generate_in_context(
        ingress, model, cid, prompt_ids, params, tag, reasoning=reasoning
    )


async def free_thread(ingress: Ingress, model: str, thread_id: str) -> None:
    """Drop the thread's context, where there is one (a deleted thread)."""
    await free(ingress, model, context_id(thread_id))
