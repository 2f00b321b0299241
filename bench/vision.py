"""Images on the CPU: time to first token of a prompt with one image, cold and with the
image cached (a second turn), and the encoder's time per image, Shoal beside
transformers' `generate` in the same run.

The model: SmolVLM-256M's shape (SigLIP encoder of 12 layers, 768 wide, 512-pixel tiles of
16-pixel patches, a 4x pixel shuffle to 64 rows a tile; SmolLM2-135M's decoder), random
weights written by transformers in float32, with SmolVLM's processor (SmolLM2's tokenizer
from the default model's package, the image tokens added; Idefics3's image processor on
Pillow). No downloads; `--keep DIR` keeps the checkpoint for the next run.

- the prompt: a chat turn of a question and one `--size` picture (a 512x512 picture is
  one tile and the whole view: 2 x 64 image rows), rendered and expanded as served;
- Shoal: the engine in-process (float32, `--threads`), TTFT of a fresh request (the image
  encoded, the prompt computed); then of the next turn (the same picture and question,
  the reply and a new question after it), whose image comes from the prefix cache; the
  encoder alone on the picture's tiles;
- transformers: `generate(max_new_tokens=1)` of both turns (it keeps no cache between
  calls), and `get_image_features` on the same pixels.

Figures are medians of `--repeats` runs, each with other pictures (so nothing is cached
across repeats). The last line printed is a JSON object with every figure.
"""

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMOLVLM_256M = dict(
    vision_config=dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=512,
        patch_size=16,
    ),
    text_config=dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    scale_factor=4,
)


def checkpoint(directory: Path) -> Path:
    if (directory / "config.json").is_file():
        return directory
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor

    from tests.models.vision_checkpoints import TEMPLATE, smolvlm_tokenizer

    tokenizer = smolvlm_tokenizer()
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    shape = {**SMOLVLM_256M, "text_config": {**SMOLVLM_256M["text_config"]}}
    shape["text_config"]["vocab_size"] = len(tokenizer)
    config = Idefics3Config(
        **shape, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(directory)
    processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 1536}, max_image_size={"longest_edge": 512}, do_image_splitting=True
    )
    Idefics3Processor(
        image_processor=processor, tokenizer=tokenizer, image_seq_len=64, chat_template=TEMPLATE
    ).save_pretrained(directory)
    return directory


def picture(seed: int, size: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def turns(image: bytes) -> tuple[list[dict], list[dict]]:
    first = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    second = first + [
        {"role": "assistant", "content": "A field of coloured noise."},
        {"role": "user", "content": "And what colour is most of it?"},
    ]
    return first, second


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", default=None, help="a directory to keep the checkpoint in")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--size", type=int, default=512, help="the picture's side in pixels")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from app.engine import EngineConfig, LLMEngine
    from app.protocol import SamplingParams
    from app.text.images import ImageLimits, encode_with_images, take_images

    with tempfile.TemporaryDirectory() as scratch:
        directory = checkpoint(Path(args.keep or scratch))
        processor = AutoProcessor.from_pretrained(directory)

        def prompt(messages: list[dict]) -> tuple[list[int], list]:
            messages, images = take_images(messages)
            text = processor.apply_chat_template(messages, add_generation_prompt=True)
            return encode_with_images(processor, text, images, ImageLimits())

        engine = LLMEngine(
            EngineConfig(model=str(directory), dtype="float32", num_threads=args.threads)
        )
        hf = Idefics3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
        hf = hf.eval()
        one = SamplingParams(temperature=0, max_tokens=1)
        shoal: dict[str, list[float]] = {"cold": [], "cached": [], "encoder": []}
        peer: dict[str, list[float]] = {"cold": [], "cached": [], "encoder": []}
        tokens = 0
        for r in range(args.repeats):
            image = picture(r, args.size)
            for name, messages in zip(("cold", "cached"), turns(image), strict=True):
                ids, images = prompt(messages)
                tokens = len(ids)
                start = time.perf_counter()
                engine.add_request(f"{r}-{name}", ids, one, images=images)
                while engine.has_work:
                    engine.step()
                shoal[name].append(time.perf_counter() - start)
                whole = processor(
                    text=processor.apply_chat_template(
                        take_images(messages)[0], add_generation_prompt=True
                    ),
                    images=[[Image.open(io.BytesIO(image)).convert("RGB")]],
                    return_tensors="pt",
                )
                start = time.perf_counter()
                with torch.inference_mode():
                    hf.generate(**whole, max_new_tokens=1, do_sample=False)
                peer[name].append(time.perf_counter() - start)
            pixels = images[0].pixels
            start = time.perf_counter()
            engine.loaded.vision([pixels])
            shoal["encoder"].append(time.perf_counter() - start)
            values = torch.as_tensor(pixels["pixel_values"])
            mask = torch.as_tensor(pixels["pixel_attention_mask"])
            start = time.perf_counter()
            with torch.inference_mode():
                hf.model.get_image_features(values, mask)
            peer["encoder"].append(time.perf_counter() - start)
            print(f"repeat {r}: shoal {shoal} transformers {peer}")
        tiles = int(images[0].pixels["pixel_values"].shape[1])
    ms = {k: round(1000 * statistics.median(v), 1) for k, v in shoal.items()}
    peer_ms = {k: round(1000 * statistics.median(v), 1) for k, v in peer.items()}
    print(f"shoal (ms): {ms}")
    print(f"transformers (ms): {peer_ms}")
    result = {
        "threads": args.threads,
        "picture": args.size,
        "tiles": tiles,
        "prompt_tokens_second_turn": tokens,
        "ttft_cold_ms": ms["cold"],
        "ttft_cached_ms": ms["cached"],
        "encoder_ms_per_image": ms["encoder"],
        "transformers": peer_ms,
        "ttft_cold_ratio": round(peer_ms["cold"] / ms["cold"], 2),
        "ttft_cached_ratio": round(peer_ms["cached"] / ms["cached"], 2),
        "encoder_ratio": round(peer_ms["encoder"] / ms["encoder"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
