"""GGUF models with llama.cpp's projector file (mmproj) beside them, Gemma 3's and
SmolVLM's, on tiny random checkpoints. For Gemma 3: the projector written as llama.cpp's converter writes it (its tensors and
metadata checked byte for byte against the converter's output for this checkpoint); the
encoder read from it gives the safetensors encoder's rows; the GGUF model with it answers
an image prompt token for token as the safetensors checkpoint does; the processor made
from the projector's metadata gives Gemma 3's processor's ids and pixels."""

import json
from pathlib import Path

import pytest
import torch

from app.models.source import resolve_model
from app.text.images import ImageLimits, encode_with_images, load_processor
from tests.helpers import tiny_engine
from tests.models.gguf_writer import write_gguf
from tests.models.mmproj_writer import write_gemma3_mmproj, write_mmproj
from tests.models.test_vision_gemma3 import GREEDY, ours, png, render
from tests.models.vision_checkpoints import save_gemma3_vision_checkpoint

pytest.importorskip("PIL")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the safetensors checkpoint, its language model as GGUF, its exact projector)."""
    import transformers

    root = tmp_path_factory.mktemp("gemma3-gguf")
    # llama.cpp's Gemma 3 files fix the layers' pattern: every 6th global
    checkpoint = save_gemma3_vision_checkpoint(root / "hf", num_hidden_layers=6, layer_types=None)
    whole = transformers.Gemma3ForConditionalGeneration.from_pretrained(checkpoint)
    language = whole.model.language_model
    model = language_gguf(checkpoint, whole, language, transformers.Gemma3ForCausalLM, root)
    return checkpoint, model, write_gemma3_mmproj(checkpoint, root / "mmproj.gguf", exact=True)


def language_gguf(checkpoint: Path, whole, language, causal_lm, root: Path) -> Path:  # noqa: ANN001
    """A multimodal checkpoint's language model (`language` of `whole`) as a GGUF file
    of the checkpoint's own vocabulary, as llama.cpp's converter writes the text part."""
    text = causal_lm(whole.config.text_config)
    text.model.load_state_dict(language.state_dict())
    text.lm_head.load_state_dict(whole.lm_head.state_dict())
    text.save_pretrained(root / "text")
    processor = load_processor(resolve_model(str(checkpoint)))
    size = json.loads((root / "text" / "config.json").read_text())["vocab_size"]
    tokens = processor.tokenizer.convert_ids_to_tokens(list(range(size)))
    return write_gguf(root / "text", root / "model.gguf", tokens=tokens)


def test_the_projectors_encoder_gives_the_checkpoints_rows(files, tmp_path):
    checkpoint, model, projector = files
    pixels = [{"pixel_values": torch.rand(1, 3, 56, 56).numpy()} for _ in range(2)]
    expected = tiny_engine(checkpoint).loaded.vision(pixels)
    exact = tiny_engine(model, mmproj=str(projector)).loaded.vision(pixels)
    halved = write_gemma3_mmproj(checkpoint, tmp_path / "f16.gguf")  # as llama.cpp ships it
    rounded = tiny_engine(model, mmproj=str(halved)).loaded.vision(pixels)
    for want, got, near in zip(expected, exact, rounded, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(near, want, atol=1e-2, rtol=1e-2)


def test_a_gguf_model_with_its_projector_answers_as_the_checkpoint(files):
    checkpoint, model, projector = files
    processor = load_processor(resolve_model(str(checkpoint)))
    parts = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "to"}]
    text = render(processor, [*parts, {"type": "image"}])
    ids, images = encode_with_images(
        processor, text, [png(30, (48, 64)), png(31, (64, 48))], ImageLimits()
    )
    expected = ours(tiny_engine(checkpoint, num_kv_blocks=128), ids, images)
    engine = tiny_engine(model, mmproj=str(projector), num_kv_blocks=128)
    assert engine.loaded.vision is not None
    assert ours(engine, ids, images) == expected
    assert len(expected) == GREEDY.max_tokens


def test_the_projectors_processor_is_gemma3s(files):
    checkpoint, _, projector = files
    processor = load_processor(resolve_model(str(checkpoint)))
    made = load_processor(resolve_model(str(checkpoint)), str(projector), processor.tokenizer)
    parts = [{"type": "text", "text": "See"}, {"type": "image"}, {"type": "text", "text": "and"}]
    text = render(processor, [*parts, {"type": "image"}])
    images = [png(32, (40, 90)), png(33, (90, 40))]
    want_ids, want = encode_with_images(processor, text, images, ImageLimits())
    got_ids, got = encode_with_images(made, text, images, ImageLimits())
    assert got_ids == want_ids
    for a, b in zip(got, want, strict=True):
        assert (a.offset, a.length, a.content_hash) == (b.offset, b.length, b.content_hash)
        torch.testing.assert_close(
            torch.as_tensor(a.pixels["pixel_values"]), torch.as_tensor(b.pixels["pixel_values"])
        )


@pytest.fixture(scope="module")
def smolvlm_files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """SmolVLM's: (the checkpoint, its Llama language model as GGUF, its projector)."""
    import transformers

    from tests.models.vision_checkpoints import save_idefics3_checkpoint

    root = tmp_path_factory.mktemp("smolvlm-gguf")
    checkpoint = save_idefics3_checkpoint(root / "hf", processor=True)
    whole = transformers.Idefics3ForConditionalGeneration.from_pretrained(checkpoint)
    language = whole.model.text_model
    model = language_gguf(checkpoint, whole, language, transformers.LlamaForCausalLM, root)
    return checkpoint, model, write_mmproj(checkpoint, root / "mmproj.gguf")


def test_a_smolvlm_gguf_with_its_projector_answers_as_the_checkpoint(smolvlm_files):
    from tests.models.vision_checkpoints import TEMPLATE

    checkpoint, model, projector = smolvlm_files
    processor = load_processor(resolve_model(str(checkpoint)))
    made = load_processor(resolve_model(str(checkpoint)), str(projector), processor.tokenizer)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}]}
    ]
    text = processor.tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    images = [png(34, (100, 80))]
    ids, inputs = encode_with_images(processor, text, images, ImageLimits())
    made_ids, made_inputs = encode_with_images(made, text, images, ImageLimits())
    assert made_ids == ids  # the projector's sizes give the checkpoint processor's tiles
    torch.testing.assert_close(
        torch.as_tensor(made_inputs[0].pixels["pixel_values"]),
        torch.as_tensor(inputs[0].pixels["pixel_values"]),
    )
    expected = ours(tiny_engine(checkpoint, num_kv_blocks=256), ids, inputs)
    engine = tiny_engine(model, mmproj=str(projector), num_kv_blocks=256)
    assert engine.loaded.vision is not None
    assert ours(engine, ids, inputs) == expected


def test_a_wrong_or_broken_projector_file_is_a_load_error(files, smolvlm_files, tmp_path):
    from app.protocol.errors import ModelLoadError

    _, model, _ = files
    _, _, smolvlm_projector = smolvlm_files
    with pytest.raises(ModelLoadError, match="vocabulary has no <image>"):
        tiny_engine(model, mmproj=str(smolvlm_projector))  # SmolVLM's, beside Gemma 3
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelLoadError, match="projector"):
        tiny_engine(model, mmproj=str(junk))
