"""Qwen2.5-VL as llama.cpp ships it: the language model as a GGUF file of architecture
qwen2vl (which transformers' GGUF reader lacks: app/models/gguf_configs.py) and the image
encoder as a projector file of type qwen2.5vl_merger. Both are written as llama.cpp's
converter writes them for this tiny checkpoint (metadata, tensor names, order and bytes
checked against its output once; tests/models/gguf_writer.py, mmproj_writer.py), with
llama.cpp's fixed window of 112 pixels, so that an image spans several windows. The
GGUF model with its projector answers an image prompt token for token as the
safetensors checkpoint does; its tokenizer and the projector's processor give the
checkpoint processor's ids and pixels."""

from pathlib import Path

import pytest
import torch

from app.models.source import resolve_model
from app.protocol.errors import ModelLoadError
from app.text.images import ImageLimits, load_processor
from app.text.tokenizer import load_tokenizer
from tests.helpers import tiny_engine
from tests.models.gguf_writer import write_gguf
from tests.models.mmproj_writer import write_mmproj
from tests.models.test_vision_gemma3 import ours, png
from tests.models.test_vision_qwen2_5_vl import prompt
from tests.models.vision_checkpoints import (
    save_gemma3_vision_checkpoint,
    save_qwen2_5_vl_checkpoint,
)

pytest.importorskip("PIL")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# 224 x 168 pixels: 8 x 6 merged tokens, windows of 4 x 4; 84 x 280: 3 x 10
IMAGES = [png(40, (224, 168)), png(41, (84, 280))]
PARTS = ["Compare", None, "to", None]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the safetensors checkpoint, its language model as GGUF, its projector)."""
    root = tmp_path_factory.mktemp("qwen-gguf")
    checkpoint = save_qwen2_5_vl_checkpoint(root / "hf", window_size=112, max_tokens=64)
    model = write_gguf(checkpoint, root / "model.gguf", tokenizer=checkpoint)
    return checkpoint, model, write_mmproj(checkpoint, root / "mmproj.gguf")


def test_a_qwen_gguf_with_its_projector_answers_as_the_checkpoint(files):
    checkpoint, model, projector = files
    processor = load_processor(resolve_model(str(checkpoint)))
    ids, inputs = prompt(processor, PARTS, IMAGES)
    expected_engine = tiny_engine(checkpoint, num_kv_blocks=128)
    engine = tiny_engine(model, mmproj=str(projector), num_kv_blocks=128)
    pixels = [i.pixels for i in inputs]
    for got, want in zip(
        engine.loaded.vision(pixels), expected_engine.loaded.vision(pixels), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ours(engine, ids, inputs) == ours(expected_engine, ids, inputs)
    assert tiny_engine(model).loaded.vision is None  # without its projector: a text model


def test_its_tokenizer_and_the_projectors_processor_give_the_checkpoints(files):
    checkpoint, model, projector = files
    processor = load_processor(resolve_model(str(checkpoint)))
    source = resolve_model(str(model))
    tokenizer = load_tokenizer(source)
    made = load_processor(source, str(projector), tokenizer)
    want_ids, want = prompt(processor, PARTS, IMAGES)
    got_ids, got = prompt(made, PARTS, IMAGES)
    assert got_ids == want_ids
    for a, b in zip(got, want, strict=True):
        assert (a.offset, a.length, a.content_hash) == (b.offset, b.length, b.content_hash)
        for key in ("pixel_values", "image_grid_thw"):
            torch.testing.assert_close(
                torch.as_tensor(a.pixels[key]), torch.as_tensor(b.pixels[key])
            )


def test_the_projector_bounds_images_as_llama_cpp_does(files):
    _, model, projector = files
    source = resolve_model(str(model))
    made = load_processor(
        source, str(projector), load_tokenizer(source), ImageLimits(max_tokens=20)
    )
    _, small = prompt(made, ["a", None], [png(42, (28, 28))])  # 1 token: scaled up to 8+
    _, big = prompt(made, ["a", None], [png(43, (560, 560))])  # 400 tokens: down to 20
    assert small[0].length >= 8 and big[0].length <= 20
    made = load_processor(source, str(projector), load_tokenizer(source))  # 8192 allowed
    _, huge = prompt(made, ["a", None], [png(44, (2240, 2240))])  # 6400 tokens: to 4096
    assert 3000 < huge[0].length <= 4096
    tiny = load_processor(source, str(projector), load_tokenizer(source), ImageLimits(max_tokens=4))
    _, shrunk = prompt(tiny, ["a", None], [png(45, (28, 28))])  # a bound under 8 holds
    assert shrunk[0].length <= 4


def test_a_projector_with_a_part_missing_or_anothers_is_a_load_error(files, tmp_path):
    import gguf

    checkpoint, model, projector = files
    reader = gguf.GGUFReader(str(projector))
    broken = gguf.GGUFWriter(str(tmp_path / "broken.gguf"), "clip")
    for name, field in reader.fields.items():
        if name.startswith("clip.") and field.types[0] == gguf.GGUFValueType.ARRAY:
            broken.add_array(name, field.contents())
        elif name.startswith("clip."):
            broken.add_key_value(name, field.contents(), field.types[0])
    for tensor in reader.tensors:
        if tensor.name != "v.blk.1.attn_k.weight":
            broken.add_tensor(tensor.name, tensor.data)
    broken.write_header_to_file()
    broken.write_kv_data_to_file()
    broken.write_tensors_to_file()
    broken.close()
    with pytest.raises(ModelLoadError, match="attn_k"):
        tiny_engine(model, mmproj=str(tmp_path / "broken.gguf"))
    gemma = tmp_path / "gemma3.gguf"
    write_mmproj(save_gemma3_vision_checkpoint(tmp_path / "gemma3"), gemma)
    with pytest.raises(ModelLoadError, match="vocabulary has no <image_soft_token>"):
        tiny_engine(model, mmproj=str(gemma))  # another family's
