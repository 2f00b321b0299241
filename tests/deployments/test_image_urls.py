"""Image URLs, fetched by the ingress through the SSRF guard: off unless the config allows
them; then bounded in bytes and time, refused on private addresses (unless listed), on
HTTP errors and on schemes other than http(s), each a 400 that says why. Real sockets
against a local image host."""

import asyncio

import pytest

from app.protocol.errors import InvalidRequestError
from app.protocol.outputs import EngineInfo
from deployments.http.image_urls import ImageFetcher
from deployments.images_config import ImagesConfig
from tests.image_host import image_host

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


def fetcher(**config) -> ImageFetcher:  # noqa: ANN003
    settings = {"allow_urls": True, "url_private_hosts": ["127.0.0.1"], **config}
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
        parts = resolve(fetcher(), f"{base}/a.png", f"{base}/b.png", f"{base}/a.png")
        redirected = resolve(fetcher(), f"{base}/redirect/a.png")
    assert parts[0] == {"type": "text", "text": "see"}
    assert [p["image"] for p in parts[1:]] == [PNG, PNG[::-1], PNG]
    assert redirected[1]["image"] == PNG


def test_messages_without_urls_are_left_as_they_are():
    messages = [{"role": "user", "content": [{"type": "image", "image": PNG}]}]
    assert asyncio.run(ImageFetcher(ImagesConfig()).resolve(messages, reads_images)) is messages


def test_a_text_model_fetches_nothing():
    with image_host({"/a.png": PNG}) as base, pytest.raises(InvalidRequestError, match="not supp"):
        resolve(fetcher(), f"{base}/a.png", info=reads_text)


@pytest.mark.parametrize(
    "config, path, says",
    [
        ({"allow_urls": False}, "/a.png", "not fetched by this server"),
        ({"url_private_hosts": []}, "/a.png", "non-public address"),
        ({}, "/missing.png", "HTTP 404"),
        ({"max_image_bytes": 100}, "/a.png", "more than 100 bytes"),  # by its length
        ({"max_image_bytes": 100_000}, "/endless", "more than 100000 bytes"),  # as it comes
        ({"url_timeout_s": 0.5}, "/slow", "could not be fetched"),
        ({}, "/to-ftp", "may not use ftp://"),
        ({"max_images": 1}, "/a.png /a.png", "at most 1"),
    ],
)
def test_refusals_are_400s_that_say_why(config, path, says):
    with image_host({"/a.png": PNG}) as base:
        urls = [base + p for p in path.split()]
        with pytest.raises(InvalidRequestError, match=says):
            resolve(fetcher(**config), *urls)


def test_a_public_name_that_resolves_to_a_private_address_is_refused():
    """DNS pointing a public-looking name at the cluster's inside (the metadata service):
    the address is checked, not the name."""
    f = ImageFetcher(ImagesConfig(allow_urls=True), resolver=lambda host, port: ["169.254.169.254"])
    with pytest.raises(InvalidRequestError, match="non-public address"):
        resolve(f, "http://images.example.com/a.png")
