"""Gemma 3 images against transformers in float32, on a tiny random checkpoint of
gemma-3-4b-it's layout with Gemma 3's own processor: the encoder's rows (SigLIP, pooled,
normed, projected); the prompt's ids (expansions that begin and end in newlines, which
merge with the text beside them); greedy output token for token with one and two images
between text, which needs an image's tokens to attend to each other both ways."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from app.models.source import resolve_model
from app.protocol import SamplingParams
from app.text.images import ImageLimits, encode_with_images, load_processor
from tests.helpers import tiny_engine
from tests.models.vision_checkpoints import save_gemma3_vision_checkpoint

pytest.importorskip("PIL")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3-vision"))


def png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def render(processor, parts: list) -> str:  # noqa: ANN001
    messages = [{"role": "user", "content": parts}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def transformers_run(checkpoint: Path, text: str, images: list[bytes]) -> tuple[list, list]:
    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(checkpoint)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=[pictures], return_tensors="pt")
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.eval().generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids) :].tolist()


def ours(engine, ids: list[int], images: list, rid: str = "r") -> list[int]:  # noqa: ANN001
    engine.add_request(rid, ids, GREEDY, images=images)
    out: list[int] = []
    while engine.has_work:
        for delta in engine.step():
            out += delta.token_ids
    return out


def test_encoder_rows_match_transformers(checkpoint):
    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    engine = tiny_engine(checkpoint)
    processor = AutoProcessor.from_pretrained(checkpoint)
    pictures = [Image.open(io.BytesIO(png(s, (40, 70)))).convert("RGB") for s in (1, 2)]
    pixels = processor.image_processor(pictures, return_tensors="pt")["pixel_values"]
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.inference_mode():
        expected = model.eval().model.get_image_features(pixels).pooler_output
    rows = engine.loaded.vision([{"pixel_values": p[None].numpy()} for p in pixels])
    torch.testing.assert_close(torch.stack(rows), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "parts",
    [
        ["Describe", None, "briefly."],
        ["Compare", None, "with", None],
        [None, "What is it?"],
    ],
    ids=["one-image", "two-images", "image-first"],
)
def test_images_between_text_match_transformers(checkpoint, parts):
    processor = load_processor(resolve_model(str(checkpoint)))
    images = [png(10 + i, (48, 64)) for i, p in enumerate(parts) if p is None]
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = render(processor, content)
    ids, inputs = encode_with_images(processor, text, images, ImageLimits())
    expected_ids, expected = transformers_run(checkpoint, text, images)
    assert ids == expected_ids  # the newlines around each image merged as the processor's
    assert all(inputs[i].length == 4 for i in range(len(images)))  # exactly the soft tokens
    assert ours(tiny_engine(checkpoint, num_kv_blocks=128), ids, inputs) == expected


def test_an_images_tokens_see_each_other_both_ways(checkpoint):
    """The same prompt with the image's tokens attending causally (as Idefics3's do)
    answers otherwise: the both-ways mask is what makes the output transformers'."""
    processor = load_processor(resolve_model(str(checkpoint)))
    text = render(processor, [{"type": "text", "text": "Look:"}, {"type": "image"}])
    ids, inputs = encode_with_images(processor, text, [png(20, (48, 64))], ImageLimits())
    engine = tiny_engine(checkpoint, num_kv_blocks=128)
    both_ways = ours(engine, ids, inputs)
    assert ours(engine, ids, inputs, "again") == both_ways  # its KV from the prefix cache
    causal_engine = tiny_engine(checkpoint, num_kv_blocks=128)
    causal_engine.loaded.vision.bidirectional = False
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outs = []
    for engine in (tiny_engine(checkpoint, num_kv_blocks=128), causal_engine):
        engine.add_request("lp", ids, params, images=inputs)
        while engine.has_work:
            outs += [d for d in engine.step() if d.logprobs]
    assert len(both_ways) == NEW_TOKENS
    tops = [dict(out.logprobs[0].top) for out in outs]
    shared = tops[0].keys() & tops[1].keys()
    assert max(abs(tops[0][t] - tops[1][t]) for t in shared) > 1e-2


def test_a_text_that_writes_image_tokens_is_refused(checkpoint):
    """Gemma 3's placeholder (<start_of_image>) is not its image token: a text holding
    the image token itself would shift every image's span; it is a 400."""
    from app.protocol.errors import InvalidRequestError

    processor = load_processor(resolve_model(str(checkpoint)))
    parts = [{"type": "text", "text": "<image_soft_token> here:"}, {"type": "image"}]
    with pytest.raises(InvalidRequestError, match="image tokens of its own"):
        encode_with_images(processor, render(processor, parts), [png(3, (48, 64))], ImageLimits())


def test_a_text_request_is_the_same_bits_beside_an_image_prefill(checkpoint):
    """On a quantized CPU model every token attends through the decode kernel, for batch
    invariance: an image's prefill in the same step takes the masked torch path alone,
    and leaves its neighbours' bits as they were."""
    from tests.helpers import cpu_engine

    processor = load_processor(resolve_model(str(checkpoint)))
    text = render(processor, [{"type": "text", "text": "Look:"}, {"type": "image"}])
    image_ids, images = encode_with_images(processor, text, [png(20, (48, 64))], ImageLimits())
    story = render(processor, [{"type": "text", "text": "Tell me a story about a cat"}])
    text_ids = processor.tokenizer(story, add_special_tokens=False).input_ids
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)

    def logprobs(neighbour: bool) -> list:
        engine = cpu_engine(checkpoint, quantization="int8", num_kv_blocks=128)
        engine.add_request("text", text_ids, params)
        if neighbour:
            engine.add_request("image", image_ids, GREEDY, images=images)
        out = []
        while engine.has_work:
            out += [d.logprobs for d in engine.step() if d.request_id == "text" and d.logprobs]
        return out

    assert logprobs(neighbour=True) == logprobs(neighbour=False)
