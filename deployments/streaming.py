"""GenerationStream: the streamed HTTP response of one Generation, in any dialect.

Its body iterator cancels the generation when it ends early, but an iterator that never
started has nothing to run: a client that leaves between the route's return and the
first byte would leave its request generating for no one. So the response itself
cancels the generation however it ends (cancelling a finished one is a no-op).
"""

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from deployments.generation import Generation


class GenerationStream(StreamingResponse):
    def __init__(
        self,
        body: AsyncIterator[str],
        generation: Generation,
        media_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(body, media_type=media_type, headers=headers)
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 (ASGI)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()
