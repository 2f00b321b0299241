"""Images on the tokenizer's side (app/text/images.py) against transformers: each image
expanded by SmolVLM's processor on its own gives the ids and pixels of the processor run
over the whole prompt, and the engine's greedy output on them equals transformers'; bad
images are refused before they are decoded."""

import base64
import io

import numpy as np
import pytest
import torch

from app.models.source import resolve_model
from app.protocol import SamplingParams
from app.protocol.errors import InvalidRequestError
from app.text.images import (
    ImageLimits,
    base64_bytes,
    data_url_bytes,
    encode_with_images,
    image_url_part,
    load_processor,
    open_image,
)
from tests.helpers import tiny_engine
from tests.models.vision_checkpoints import save_idefics3_checkpoint

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_idefics3_checkpoint(tmp_path_factory.mktemp("smolvlm"), processor=True)


def png(seed: int, size: tuple[int, int], kind: str = "PNG") -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, kind)
    return out.getvalue()


def test_images_expand_as_the_whole_processor_does_and_generate_as_transformers(checkpoint):
    from PIL import Image
    from transformers import Idefics3ForConditionalGeneration

    processor = load_processor(resolve_model(str(checkpoint)))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image"},
                {"type": "text", "text": "with"},
                {"type": "image"},
            ],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    images = [png(1, (80, 100)), png(2, (40, 30), "JPEG")]
    ids, inputs = encode_with_images(processor, text, images, ImageLimits())

    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    whole = processor(text=text, images=[pictures], return_tensors="pt")
    assert ids == whole["input_ids"][0].tolist()
    ours = np.concatenate([i.pixels["pixel_values"] for i in inputs], axis=1)
    assert np.array_equal(ours, whole["pixel_values"].numpy())
    for image in inputs:  # each span starts and ends on its placeholders' tokens
        span = ids[image.offset : image.offset + image.length]
        assert span.count(processor.image_token_id) == image.pixels["pixel_values"].shape[1] * 16

    model = Idefics3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        expected = model.eval().generate(**whole, max_new_tokens=8, do_sample=False)
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("r", ids, params, images=inputs)
    out = []
    while engine.has_work:
        for delta in engine.step():
            out += delta.token_ids
    assert out == expected[0, len(ids) :].tolist()


def test_bad_images_are_refused_before_they_are_decoded(checkpoint):
    limits = ImageLimits(max_images=1, max_bytes=50_000, max_pixels=100 * 100)
    with pytest.raises(InvalidRequestError, match="not an image"):
        open_image(b"GIF89a but not really", limits)
    with pytest.raises(InvalidRequestError, match="bytes; at most"):
        open_image(b"\0" * 50_001, limits)
    with pytest.raises(InvalidRequestError, match="more than"):
        open_image(png(3, (101, 100)), limits)
    truncated = png(4, (64, 64))[:200]
    with pytest.raises(InvalidRequestError, match="corrupt|not an image"):
        open_image(truncated, limits)
    # a bomb: a tiny file whose header says 20000 x 20000
    from PIL import Image

    bomb = io.BytesIO()
    Image.new("1", (20000, 20000)).save(bomb, "PNG")
    assert len(bomb.getvalue()) < 50_000
    with pytest.raises(InvalidRequestError, match="more than"):
        open_image(bomb.getvalue(), ImageLimits(max_pixels=10**7))
    processor = load_processor(resolve_model(str(checkpoint)))
    with pytest.raises(InvalidRequestError, match="base64"):
        base64_bytes("not base64!", "images")
    with pytest.raises(InvalidRequestError, match="data URL"):
        image_url_part("ftp://example.com/a.png", "messages")
    with pytest.raises(InvalidRequestError, match="must be base64"):
        data_url_bytes("data:image/png,abc", "messages")
    with pytest.raises(InvalidRequestError, match="at most 1"):
        encode_with_images(processor, "<image><image>", [png(5, (8, 8))] * 2, limits)
    with pytest.raises(InvalidRequestError, match="image places"):
        encode_with_images(processor, "no place", [png(5, (8, 8))], limits)
    few_tokens = ImageLimits(max_tokens=16)  # an image here takes 80 (a tile and the whole)
    with pytest.raises(InvalidRequestError, match="more than 16 tokens"):
        encode_with_images(processor, "<image>", [png(6, (100, 100))], few_tokens)


def test_base64_as_clients_send_it():
    data = png(6, (16, 16))
    encoded = base64.b64encode(data).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))  # MIME's
    assert base64_bytes(wrapped, "images") == data
    assert base64_bytes(encoded.rstrip("="), "images") == data  # unpadded
    assert data_url_bytes("DATA:image/png;base64," + encoded, "messages") == data
