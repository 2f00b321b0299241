"""Images in prompts (`images` in AppConfig): the bounds every image meets before it is
decoded, and whether the ingress fetches image URLs. Its own file so that config.py
stays a page."""

from pydantic import BaseModel, ConfigDict, Field

from app.text.images import ImageLimits


class ImagesConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_images: int = Field(8, ge=1, description="Images in one request; past it 400.")
    max_image_bytes: int = Field(
        20 * 2**20,
        ge=1,
        description="One image, encoded; past it 400. An image sent inside the request "
        "(base64) also counts toward max_request_bytes.",
    )
    max_pixels: int = Field(
        7680 * 4320,
        ge=1,
        description="One image's width x height, read from its header before any pixel is "
        "decoded (so a decompression bomb never is); past it 400.",
    )
    max_image_tokens: int = Field(
        8192,
        ge=1,
        description="The prompt tokens a request's images take, all together, as the model's "
        "processor sizes them (what the encoder computes, and the pixels that travel to the "
        "replica: Qwen2.5-VL's are 5 KiB a token); past it 400.",
    )
    allow_urls: bool = Field(
        False,
        description="Fetch http(s) image URLs (OpenAI image_url, Responses input_image, "
        "Anthropic url sources). Off: only images sent in the request (data URLs, base64); "
        "a URL gets a 400. On, the ingress fetches through the SSRF guard "
        "(deployments/url_guard.py): public addresses only, every redirect checked.",
    )
    url_private_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts an image URL may name although they resolve to a private, "
        "loopback or link-local address (an image store inside the cluster).",
    )
    url_ports: list[int] = Field(
        default_factory=lambda: [80, 443], description="The ports an image URL may name."
    )
    url_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A request's image URLs, all fetched, redirects and name lookups "
        "included; past it 400.",
    )

    def limits(self) -> ImageLimits:
        return ImageLimits(
            self.max_images, self.max_image_bytes, self.max_pixels, self.max_image_tokens
        )
