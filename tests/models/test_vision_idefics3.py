"""Idefics3 (SmolVLM) images through the engine against transformers in float32: a tiny
random checkpoint of the real layout, images made by transformers' own image processor
(tiles and a global view), greedy output token for token; then the prefix cache, chunked
prefill and refusals."""

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from app.protocol import SamplingParams
from app.protocol.errors import InvalidRequestError
from app.protocol.images import ImageInput
from tests.helpers import tiny_engine
from tests.models.vision_checkpoints import image_processor, save_idefics3_checkpoint

pytest.importorskip("PIL")

VOCAB, IMAGE, FAKE, GLOBAL = 300, 290, 291, 292
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_idefics3_checkpoint(tmp_path_factory.mktemp("idefics3"), VOCAB, IMAGE)


def processed(seed: int, size: tuple[int, int]) -> dict:
    """A random picture through Idefics3's image processor: tiles of TILE pixels and the
    whole picture, with the tile grid."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    processor = image_processor()
    out = processor(images=[Image.fromarray(pixels)], return_row_col_info=True, return_tensors="pt")
    return dict(out)


def image_tokens(image: dict) -> list[int]:
    """The processor's layout of an image in the prompt: each tile tagged, then the
    global view, between fake tokens (tags here are plain ids of the tiny vocabulary)."""
    rows, cols = image["rows"][0][0], image["cols"][0][0]
    tokens = []
    for r in range(rows):
        for c in range(cols):
            tokens += [FAKE, 200 + r * 6 + c] + [IMAGE] * 16
    return tokens + [FAKE, GLOBAL] + [IMAGE] * 16 + [FAKE]


def build(parts: list) -> tuple[list[int], list[ImageInput], list[dict]]:
    """A prompt of text (lists of ids) and images (processed dicts), in order."""
    tokens: list[int] = []
    inputs, images = [], []
    for part in parts:
        if isinstance(part, list):
            tokens += part
            continue
        span = image_tokens(part)
        pixels = {k: part[k] for k in ("pixel_values", "pixel_attention_mask")}
        key = int.from_bytes(hashlib.sha256(part["pixel_values"].numpy().tobytes()).digest()[:8])
        inputs.append(ImageInput(key, len(tokens), len(span), pixels))
        images.append(part)
        tokens += span
    return tokens, inputs, images


def transformers_greedy(directory: Path, tokens: list[int], images: list[dict]) -> list[int]:
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([tokens])
    extra = {}
    if images:
        extra["pixel_values"] = torch.cat([i["pixel_values"] for i in images], dim=1)
        extra["pixel_attention_mask"] = torch.cat(
            [i["pixel_attention_mask"] for i in images], dim=1
        )
    with torch.inference_mode():
        out = model.eval().generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            **extra,
        )
    return out[0, len(tokens) :].tolist()


def ours(engine, tokens: list[int], images: list[ImageInput], rid: str = "r") -> list[int]:
    engine.add_request(rid, tokens, GREEDY, images=images)
    out: list[int] = []
    while engine.has_work:
        for delta in engine.step():
            out += delta.token_ids
    return out


def test_one_and_two_images_between_text_match_transformers(checkpoint):
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    wide, small = processed(1, (80, 100)), processed(2, (40, 30))  # 4 tiles + global; 1 + 1
    prompts = [
        [[1, 5, 9], wide, [17, 3]],
        [[4], small, [8, 8, 2], wide, [6]],
        [wide, small],  # image first, images back to back
    ]
    for parts in prompts:
        tokens, inputs, images = build(parts)
        expected = transformers_greedy(checkpoint, tokens, images)
        assert ours(engine, tokens, inputs) == expected


def test_the_image_decides_the_output(checkpoint):
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    a = build([[1, 5], processed(3, (64, 64)), [9]])
    b = build([[1, 5], processed(4, (64, 64)), [9]])
    assert a[0] == b[0]  # the same token ids...
    assert ours(engine, a[0], a[1], "a") != ours(engine, b[0], b[1], "b")  # ...not the same


def test_a_repeated_image_is_served_from_the_prefix_cache(checkpoint):
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    calls = []
    vision = engine.loaded.vision
    engine.loaded.vision = lambda images: calls.append(len(images)) or vision(images)
    engine.loaded.vision.image_token_id, engine.loaded.vision.rows = IMAGE, vision.rows
    picture, other = processed(5, (80, 100)), processed(6, (80, 100))
    first = build([[1, 5, 9], picture, [17, 3]])
    ours(engine, *first[:2])
    assert calls == [1]
    second = build([[1, 5, 9], picture, [17, 3, 44, 45]])  # a longer turn, same image
    engine.add_request("again", second[0], GREEDY, images=second[1])
    engine.step()
    seq = next(iter(engine.scheduler.running))
    assert seq.num_cached_tokens >= len(first[0]) - 4  # all but a partial block
    assert calls == [1]  # not encoded again
    while engine.has_work:
        engine.step()
    third = build([[1, 5, 9], other, [17, 3]])  # same ids, another image: no hit past it
    engine.add_request("other", third[0], GREEDY, images=third[1])
    engine.step()
    seq = next(iter(engine.scheduler.running))
    assert seq.num_cached_tokens <= 4  # the block of 1, 5, 9 and a fake token only
    assert calls == [1, 1]


def test_chunked_prefill_never_splits_an_image(checkpoint):
    engine = tiny_engine(checkpoint, num_kv_blocks=256, max_num_batched_tokens=24)
    tokens, inputs, images = build([[1, 5, 9], processed(7, (80, 100)), [17, 3]])
    spans = [(i.offset, i.offset + i.length) for i in inputs]
    ends = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        ends.extend(
            s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )
        return batch

    engine.scheduler.schedule = recording
    assert ours(engine, tokens, inputs) == transformers_greedy(checkpoint, tokens, images)
    assert not [e for e in ends for s0, s1 in spans if s0 < e < s1]


def test_images_are_refused_where_they_cannot_be_read(checkpoint, tmp_path):
    from tests.models.family_checkpoints import save_family_checkpoint

    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    tokens, inputs, _ = build([[1], processed(8, (64, 64)), [2]])
    short = [ImageInput(inputs[0].content_hash, 1, 10, inputs[0].pixels)]
    with pytest.raises(InvalidRequestError, match="placeholder"):
        engine.add_request("short", tokens, GREEDY, images=short)
    outside = [ImageInput(inputs[0].content_hash, 1, 500, inputs[0].pixels)]
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.add_request("outside", tokens, GREEDY, images=outside)
    text = tiny_engine(save_family_checkpoint(tmp_path, "qwen3"))
    with pytest.raises(InvalidRequestError, match="does not read images"):
        text.add_request("text", [1, 2, 3], GREEDY, images=inputs)


@pytest.mark.live  # the engine in its own process, as a replica runs it
def test_images_cross_to_the_engine_process(checkpoint):
    import asyncio

    from app.engine.engine_process import EngineProcess
    from app.protocol.messages import EngineRequest
    from tests.helpers import tiny_config

    tokens, inputs, images = build([[1, 5, 9], processed(9, (80, 100)), [17, 3]])
    request = EngineRequest("r", tokens, GREEDY, None, tuple(inputs))
    proc = EngineProcess(tiny_config(checkpoint, num_kv_blocks=256))
    try:

        async def collect() -> list[int]:
            return [t async for d in proc.generate(request) for t in d.token_ids]

        assert asyncio.run(collect()) == transformers_greedy(checkpoint, tokens, images)
    finally:
        proc.shutdown()


def test_hashes_alike_in_their_low_bits_never_share_kv(checkpoint):
    # 30 bits of a hash were once all that told two images apart: a birthday search over
    # bytes appended to a PNG found two that matched in 0.07 s.
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    a = build([[1, 5, 9], processed(10, (64, 64)), [17]])
    b = build([[1, 5, 9], processed(11, (64, 64)), [17]])
    alike = ImageInput(a[1][0].content_hash + (1 << 30), *astuple_rest(b[1][0]))
    first = ours(engine, a[0], a[1], "a")
    engine.add_request("b", b[0], GREEDY, images=[alike])
    engine.step()
    assert next(iter(engine.scheduler.running)).num_cached_tokens <= 4
    while engine.has_work:
        engine.step()
    fresh = tiny_engine(checkpoint, num_kv_blocks=256)
    assert ours(fresh, b[0], b[1], "b") != first


def astuple_rest(image: ImageInput) -> tuple:
    return image.offset, image.length, image.pixels


def test_pixels_not_in_the_encoders_tiles_are_refused(checkpoint):
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    tokens, inputs, _ = build([[1], processed(12, (64, 64)), [2]])
    values = inputs[0].pixels["pixel_values"]
    for pixels in (
        {"pixel_values": values[..., :32]},  # not square tiles
        {"pixel_values": values[0, 0]},  # no tile axis
        {"pixel_values": values, "pixel_attention_mask": np.ones((1, 1, 8, 8), bool)},
    ):
        bad = [ImageInput(1, inputs[0].offset, inputs[0].length, pixels)]
        with pytest.raises(InvalidRequestError, match="pixel"):
            engine.add_request("bad", tokens, GREEDY, images=bad)
    assert ours(engine, tokens, inputs) == ours(tiny_engine(checkpoint), tokens, inputs, "again")
