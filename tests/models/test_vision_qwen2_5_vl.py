"""Qwen2.5-VL images against transformers in float32, on a tiny random checkpoint of its
layout: the vision transformer's rows (windows, full-attention layers, 2-D rotary
positions, the merger), and greedy output token for token with one and two images of
different sizes between text, which needs the language model's 3-D rotary positions
(images take fewer positions than tokens; the text after them and every generated token
are shifted by what they saved)."""

import io
from pathlib import Path

import pytest
import torch

from app.models.source import resolve_model
from app.protocol.errors import InvalidRequestError
from app.text.images import ImageLimits, encode_with_images, load_processor
from tests.helpers import tiny_engine
from tests.models.test_vision_gemma3 import NEW_TOKENS, ours, png
from tests.models.vision_checkpoints import save_qwen2_5_vl_checkpoint

pytest.importorskip("PIL")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))


def prompt(processor, parts: list, images: list[bytes]) -> tuple[list[int], list]:  # noqa: ANN001
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    messages = [{"role": "user", "content": content}]
    text = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return encode_with_images(processor, text, images, ImageLimits())


def transformers_greedy(checkpoint: Path, ids: list[int], inputs: list) -> list[int]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([ids])
    extra = {
        "pixel_values": torch.cat([torch.as_tensor(i.pixels["pixel_values"]) for i in inputs]),
        "image_grid_thw": torch.cat([torch.as_tensor(i.pixels["image_grid_thw"]) for i in inputs]),
        "mm_token_type_ids": (input_ids == model.config.image_token_id).int(),
    }
    with torch.inference_mode():
        out = model.eval().generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            **extra,
        )
    return out[0, len(ids) :].tolist()


def test_encoder_rows_match_transformers(checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    processor = load_processor(resolve_model(str(checkpoint)))
    _, inputs = prompt(processor, ["a", None, "b", None], [png(1, (60, 90)), png(2, (90, 60))])
    engine = tiny_engine(checkpoint)
    rows = engine.loaded.vision([i.pixels for i in inputs])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    pixels = torch.cat([torch.as_tensor(i.pixels["pixel_values"]) for i in inputs])
    grid = torch.cat([torch.as_tensor(i.pixels["image_grid_thw"]) for i in inputs])
    with torch.inference_mode():
        expected = model.eval().model.get_image_features(pixels, grid).pooler_output
    assert [len(r) for r in rows] == [len(e) for e in expected] == [6, 6]
    for got, want in zip(rows, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "parts, sizes",
    [
        (["Describe", None, "briefly."], [(60, 90)]),
        (["Compare", None, "with", None], [(60, 90), (112, 56)]),
        ([None, "What is it?"], [(84, 84)]),
    ],
    ids=["one-image", "two-images", "image-first"],
)
def test_images_between_text_match_transformers(checkpoint, parts, sizes):
    processor = load_processor(resolve_model(str(checkpoint)))
    images = [png(10 + i, size) for i, size in enumerate(sizes)]
    ids, inputs = prompt(processor, parts, images)
    engine = tiny_engine(checkpoint, num_kv_blocks=128)
    expected = transformers_greedy(checkpoint, ids, inputs)
    assert ours(engine, ids, inputs) == expected
    assert ours(engine, ids, inputs, "again") == expected  # its KV from the prefix cache


def test_a_tied_checkpoint_loads_and_matches_transformers(tmp_path):
    """Qwen2.5-VL-3B ties its embeddings, said on the outer config only: no lm_head."""
    checkpoint = save_qwen2_5_vl_checkpoint(tmp_path, tied=True)
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        assert not any("lm_head" in k for k in f.keys())  # noqa: SIM118
    processor = load_processor(resolve_model(str(checkpoint)))
    ids, inputs = prompt(processor, ["Describe", None], [png(40, (60, 90))])
    engine = tiny_engine(checkpoint, num_kv_blocks=128)
    assert ours(engine, ids, inputs) == transformers_greedy(checkpoint, ids, inputs)


def test_raw_prompts_wrap_an_image_as_the_template_does(checkpoint):
    """llama.cpp's media marker in a raw prompt: the vision start and end tokens around
    the image's pads, as Qwen's template writes them (and llama.cpp's mtmd)."""
    processor = load_processor(resolve_model(str(checkpoint)))
    image = png(41, (60, 90))
    raw, _ = encode_with_images(
        processor, "Describe <__media__> now", [image], ImageLimits(), "<__media__>"
    )
    written = "Describe <|vision_start|><|image_pad|><|vision_end|> now"
    templated, _ = encode_with_images(processor, written, [image], ImageLimits())
    assert raw == templated


def test_big_photos_are_scaled_down_to_the_token_budget(checkpoint):
    from PIL import Image

    processor = load_processor(resolve_model(str(checkpoint)), limits=ImageLimits(max_tokens=24))
    photo = io.BytesIO()
    Image.new("RGB", (4032, 3024), (120, 30, 200)).save(photo, "PNG")  # a phone's size
    _, inputs = prompt(processor, [None], [photo.getvalue()])
    assert 0 < inputs[0].length <= 24
    with pytest.raises(InvalidRequestError, match="refused an image"):  # its aspect ratio
        prompt(processor, [None], [png(43, (2, 1000))])
