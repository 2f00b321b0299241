"""Images a request names by URL, read by the ingress before its prompt is rendered.

Every dialect puts an image in its chat turn as {"type": "image", "image": bytes}, or,
for a URL, {"type": "image", "url": url}; `ImageFetcher.resolve` turns the second into
the first. A data URL is decoded; an http(s) URL is fetched only where the config allows
it (`images.allow_urls`), and only through the SSRF guard (deployments/url_guard.py:
public addresses on the allowed ports, every redirect and connection checked). A
request's fetches run together, on the ingress's event loop, under one deadline that
covers everything (name lookups, connections, headers, redirects, bodies), each bounded
in bytes (the header's length, then what arrives); the first to fail cancels the
others, and so does a client that goes away. A few fetches run at once in the whole
ingress; the rest wait within their deadline. A URL that cannot be fetched is the
client's to fix: a 400 that says which, and not why (the guard's reasons, such as what
an internal name resolves to, go to the log only)."""

import asyncio
import logging
from collections.abc import Awaitable, Callable
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
    guarded_async_client,
    system_resolver,
)

logger = logging.getLogger("ray.serve")
MAX_FETCHES = 16  # at once, in one ingress


class ImageFetcher:
    def __init__(self, config: ImagesConfig, resolver: Resolver = system_resolver) -> None:
        self.config = config
        self.policy = HostPolicy.for_images(config.url_private_hosts, resolver, config.url_ports)
        self._client: httpx2.AsyncClient | None = None  # made on the first URL
        self._slots = asyncio.Semaphore(MAX_FETCHES)

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
        if len(parts) > self.config.max_images:
            raise InvalidRequestError(
                f"{len(parts)} images in a request; at most {self.config.max_images}", "messages"
            )
        named = [part["url"] for part in parts if "url" in part]
        if not named:
            return messages
        images = {u: data_url_bytes(u, "messages") for u in named if u[:5].lower() == "data:"}
        urls = list(dict.fromkeys(u for u in named if u not in images))
        if urls and not self.config.allow_urls:
            raise InvalidRequestError(
                "image URLs are not fetched by this server: send the image itself, as a data "
                "URL (data:image/png;base64,...) or base64",
                "messages",
            )
        if urls:
            images.update(await self._fetch_all(urls))
        return [_with_bytes(m, images) for m in messages]

    async def _fetch_all(self, urls: list[str]) -> dict[str, bytes]:
        limit = self.config.url_timeout_s
        try:
            async with asyncio.timeout(limit):
                fetched = await self._together(urls)
        except TimeoutError:
            raise InvalidRequestError(
                f"image URLs could not be fetched within {limit:g} s", "messages"
            ) from None
        return dict(zip(urls, fetched, strict=True))

    async def _together(self, urls: list[str]) -> list[bytes]:
        # gather, not a TaskGroup: the first failure is raised as itself (an except*
        # clause re-raising it wraps it in a group on Python 3.11 before 3.11.4)
        tasks = [asyncio.ensure_future(self.fetch(url)) for url in urls]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # the rest, once one has failed (done ones are untouched)
                task.cancel()

    async def fetch(self, url: str) -> bytes:
        """The bytes at `url`, within the config's bounds; a 400 otherwise."""
        limit = self.config.max_image_bytes
        async with self._slots:
            try:
                async with self.client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise InvalidRequestError(
                            f"image URL {url!r} answered HTTP {response.status_code}", "messages"
                        )
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > limit:
                        raise _too_large(url, limit)
                    data = bytearray()
                    async for chunk in response.aiter_bytes():
                        data += chunk
                        if len(data) > limit:
                            raise _too_large(url, limit)
                    return bytes(data)
            except TargetRefusedError as exc:
                logger.info("image URL %r refused: %s", url, exc.message)
                raise InvalidRequestError(
                    f"image URL {url!r} is refused: images are fetched over http(s) from "
                    "public hosts, on the ports this server allows",
                    "messages",
                ) from None
            except (httpx2.HTTPError, httpx2.InvalidURL, OSError) as exc:
                logger.info("image URL %r not fetched: %r", url, exc)
                raise InvalidRequestError(
                    f"image URL {url!r} could not be fetched", "messages"
                ) from None

    @property
    def client(self) -> httpx2.AsyncClient:
        if self._client is None:
            self._client = guarded_async_client(self.policy, self.config.url_timeout_s, MAX_FETCHES)
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
