"""Image URLs, fetched by the ingress through the SSRF guard: off unless the config allows
them; then bounded in bytes and time, refused on private addresses (unless listed), on
HTTP errors and on schemes other than http(s), each a 400 that says why. Real sockets
against a local image host."""

import asyncio
import time

import pytest

from app.protocol.errors import InvalidRequestError
from app.protocol.outputs import EngineInfo
from deployments.http.image_urls import ImageFetcher
from deployments.images_config import ImagesConfig
from tests.image_host import image_host

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


def fetcher(base: str, **config) -> ImageFetcher:  # noqa: ANN003
    """A fetcher that may reach the local image host at `base` (a private address)."""
    port = int(base.rsplit(":", 1)[1])
    settings = {
        "allow_urls": True,
        "url_private_hosts": ["127.0.0.1"],
        "url_ports": [port],
        **config,
    }
    return ImageFetcher(ImagesConfig(**settings))


async def reads_images() -> EngineInfo:
    return EngineInfo("vlm", 4096, reads_images=True)


async def reads_text() -> EngineInfo:
    return EngineInfo("llm", 4096)


def resolve(f: ImageFetcher, *urls: str, info=reads_images) -> list:  # noqa: ANN001
    content = [{"type": "text", "text": "see"}] + [{"type": "image", "url": u} for u in urls]
    out = asyncio.run(f.resolve([{"role": "user", "content": content}], info))
    return out[0]["content"]


def test_urls_are_fetched_in_place_and_once_each():
    with image_host({"/a.png": PNG, "/b.png": PNG[::-1]}) as base:
        parts = resolve(fetcher(base), f"{base}/a.png", f"{base}/b.png", f"{base}/a.png")
        redirected = resolve(fetcher(base), f"{base}/redirect/a.png")
    assert parts[0] == {"type": "text", "text": "see"}
    assert [p["image"] for p in parts[1:]] == [PNG, PNG[::-1], PNG]
    assert redirected[1]["image"] == PNG


def test_messages_without_urls_are_left_as_they_are():
    messages = [{"role": "user", "content": [{"type": "image", "image": PNG}]}]
    assert asyncio.run(ImageFetcher(ImagesConfig()).resolve(messages, reads_images)) is messages


def test_a_text_model_fetches_nothing():
    with image_host({"/a.png": PNG}) as base, pytest.raises(InvalidRequestError, match="not supp"):
        resolve(fetcher(base), f"{base}/a.png", info=reads_text)


@pytest.mark.parametrize(
    "config, path, says",
    [
        ({"allow_urls": False}, "/a.png", "not fetched by this server"),
        ({"url_private_hosts": []}, "/a.png", "is refused"),
        ({"url_ports": [80, 443]}, "/a.png", "is refused"),
        ({}, "/missing.png", "HTTP 404"),
        ({"max_image_bytes": 100}, "/a.png", "more than 100 bytes"),  # by its length
        ({"max_image_bytes": 100_000}, "/endless", "more than 100000 bytes"),  # as it comes
        ({"url_timeout_s": 0.5}, "/slow", "within 0.5 s"),
        ({"url_timeout_s": 0.5}, "/slow-headers", "within 0.5 s"),
        ({}, "/to-ftp", "is refused"),
        ({"max_images": 1}, "/a.png /b.png", "at most 1"),
    ],
)
def test_refusals_are_400s_that_say_why(config, path, says):
    with image_host({"/a.png": PNG}) as base:
        urls = [base + p for p in path.split()]
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match=says) as refused:
            resolve(fetcher(base, **config), *urls)
        assert time.monotonic() - started < 3.0  # every bound holds the whole fetch
    assert "127.0.0.1 (" not in refused.value.message  # what names resolve to stays in the log


def test_a_failed_url_cancels_the_rest_of_its_request():
    with image_host({"/a.png": PNG}) as base:
        f = fetcher(base, url_timeout_s=5.0)
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match="HTTP 404"):
            resolve(f, f"{base}/slow", f"{base}/missing.png", f"{base}/slow-headers")
        assert time.monotonic() - started < 2.0  # the slow ones did not run on


def test_a_public_name_that_resolves_to_a_private_address_is_refused():
    """DNS pointing a public-looking name at the cluster's inside (the metadata service):
    the address is checked, not the name."""
    f = ImageFetcher(ImagesConfig(allow_urls=True), resolver=lambda host, port: ["169.254.169.254"])
    with pytest.raises(InvalidRequestError, match="is refused"):
        resolve(f, "http://images.example.com/a.png")


def test_slow_name_lookups_are_bounded_and_refused_at_once_when_all_are_busy():
    """A name server that never answers (a client may choose one) holds a lookup thread
    past its request's deadline; when every lookup thread is held, a fetch is a 503 at
    once rather than a wait that would time out in another client's name."""
    from app.protocol.errors import OverloadedError
    from deployments.url_guard import LOOKUP_THREADS, AsyncGuardedBackend

    def silent(host: str, port: int) -> list[str]:
        time.sleep(1.5)
        return ["93.184.216.34"]

    slow = ImageFetcher(ImagesConfig(allow_urls=True, url_timeout_s=0.3), resolver=silent)
    urls = [f"http://slow{i}.example/a.png" for i in range(LOOKUP_THREADS)]
    with pytest.raises(InvalidRequestError, match="within 0.3 s"):
        resolve(slow, *urls)
    started = time.monotonic()
    with pytest.raises(OverloadedError, match="retry"):
        resolve(slow, "http://another.example/a.png")
    assert time.monotonic() - started < 0.2
    deadline = time.monotonic() + 5
    while AsyncGuardedBackend.busy and time.monotonic() < deadline:
        time.sleep(0.05)  # the held threads end their lookups
    assert AsyncGuardedBackend.busy == 0
