"""Images a request names by URL, read by the ingress before its prompt is rendered.

Every dialect puts an image in its chat turn as {"type": "image", "image": bytes}, or,
for a URL, {"type": "image", "url": url}; `ImageFetcher.resolve` turns the second into
the first. A data URL is decoded; an http(s) URL is fetched only where the config allows
it (`images.allow_urls`), and only
through the SSRF guard (deployments/url_guard.py: public addresses, every redirect and
connection checked), bounded in bytes (the header's length, then what arrives) and in
time (the whole fetch). A URL that cannot be fetched is the client's to fix: a 400.
Fetches run on a few threads of their own, so slow image hosts never hold up the
ingress's other work."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2

from app.protocol.errors import InvalidRequestError
from app.protocol.outputs import EngineInfo
from app.text.images import data_url_bytes
from deployments.images_config import ImagesConfig
from deployments.url_guard import (
    HostPolicy,
    Resolver,
    TargetRefusedError,
    guarded_client,
    system_resolver,
)

FETCH_THREADS = 8


class ImageFetcher:
    def __init__(self, config: ImagesConfig, resolver: Resolver = system_resolver) -> None:
        self.config = config
        self.policy = HostPolicy.for_images(config.url_private_hosts, resolver)
        self._client: httpx2.Client | None = None  # made on the first URL
        self._threads: ThreadPoolExecutor | None = None

    async def resolve(
        self, messages: list[dict[str, Any]], info: Callable[[], Awaitable[EngineInfo]]
    ) -> list[dict[str, Any]]:
        """`messages` with each URL image part replaced by the image's bytes. `info`: the
        model's EngineInfo, asked only when there are images: a model that reads none
        refuses them here, before any URL is fetched for it."""
        parts = [
            part
            for m in messages
            if isinstance(m.get("content"), list)
            for part in m["content"]
            if part.get("type") == "image"
        ]
        if not parts:
            return messages
        if not (await info()).reads_images:
            raise InvalidRequestError(
                "image input is not supported: this model does not read images; send text only",
                "messages",
            )
        named = [part["url"] for part in parts if "url" in part]
        if not named:
            return messages
        images = {u: data_url_bytes(u, "messages") for u in named if u[:5].lower() == "data:"}
        urls = [u for u in named if u not in images]
        if urls and not self.config.allow_urls:
            raise InvalidRequestError(
                "image URLs are not fetched by this server: send the image itself, as a data "
                "URL (data:image/png;base64,...) or base64",
                "messages",
            )
        if len(urls) > self.config.max_images:
            raise InvalidRequestError(
                f"{len(urls)} image URLs in a request; at most {self.config.max_images}",
                "messages",
            )
        if urls:
            images.update(await self._fetch_all(list(dict.fromkeys(urls))))
        return [_with_bytes(m, images) for m in messages]

    async def _fetch_all(self, urls: list[str]) -> dict[str, bytes]:
        loop = asyncio.get_running_loop()
        if self._threads is None:
            self._threads = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="image-url")
        fetched = await asyncio.gather(
            *(loop.run_in_executor(self._threads, self.fetch, url) for url in urls)
        )
        return dict(zip(urls, fetched, strict=True))

    def fetch(self, url: str) -> bytes:
        """The bytes at `url`, within the config's bounds; a 400 otherwise."""
        limit, deadline = self.config.max_image_bytes, time.monotonic() + self.config.url_timeout_s
        try:
            with self.client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequestError(
                        f"image URL {url!r} answered HTTP {response.status_code}", "messages"
                    )
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise _too_large(url, limit)
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise _too_large(url, limit)
                    if time.monotonic() > deadline:
                        raise httpx2.ReadTimeout("the whole fetch took too long")
                return bytes(data)
        except InvalidRequestError:
            raise
        except TargetRefusedError as exc:  # the client named a host it may not
            raise InvalidRequestError(f"image URL {url!r}: {exc.message}", "messages") from None
        except (httpx2.HTTPError, httpx2.InvalidURL, OSError) as exc:
            raise InvalidRequestError(
                f"image URL {url!r} could not be fetched: {exc or type(exc).__name__}", "messages"
            ) from None

    @property
    def client(self) -> httpx2.Client:
        if self._client is None:
            self._client = guarded_client(self.policy, timeout_s=self.config.url_timeout_s)
        return self._client


def _too_large(url: str, limit: int) -> InvalidRequestError:
    return InvalidRequestError(f"image URL {url!r} holds more than {limit} bytes", "messages")


def _with_bytes(message: dict[str, Any], images: dict[str, bytes]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [
        {"type": "image", "image": images[p["url"]]}
        if p.get("type") == "image" and "url" in p
        else p
        for p in content
    ]
    return {**message, "content": parts}
