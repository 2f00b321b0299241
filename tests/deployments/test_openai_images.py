"""Images through the OpenAI chat route, with the official client, on a tiny random
SmolVLM checkpoint (its real processor and tokenizer): data-URL image_url parts are
expanded by the processor and encoded by the engine, token for token as transformers
generates; the default text model, a URL that is not data, or a corrupt image is a 400."""

import base64
import io

import numpy as np
import openai
import pytest
import torch

from deployments.config import AppConfig
from tests.helpers import tiny_engine
from tests.local_app import MODEL, http_client, local_app, run
from tests.models.vision_checkpoints import save_idefics3_checkpoint

pytest.importorskip("PIL")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
VLM = "smolvlm-tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_idefics3_checkpoint(tmp_path_factory.mktemp("smolvlm"), processor=True)


def picture(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(app, model: str, content: list, max_tokens: int = 6):  # noqa: ANN201
    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            return await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": content}],
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )

    return run(go())


def transformers_reply(checkpoint, text_parts: list, images: list[bytes], n: int) -> list[int]:
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": text_parts}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=[pictures], return_tensors="pt")
    model = Idefics3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.eval().generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_image_url_parts_are_read_as_transformers_reads_them(checkpoint):
    config = AppConfig.model_validate(
        {"models": [{"name": VLM, "engine": {"model": str(checkpoint)}}]}
    )
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    images = [picture(1, (80, 100)), picture(2, (40, 30))]
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_url(images[0])}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": data_url(images[1])}},
    ]
    with local_app(config, engine) as (app, _):
        reply = chat(app, VLM, content)
        other = chat(app, VLM, content[:1] + [content[3]])
        with pytest.raises(openai.BadRequestError, match="data URL"):
            chat(
                app, VLM, [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
            )
        with pytest.raises(openai.BadRequestError, match="not an image"):
            chat(app, VLM, [{"type": "image_url", "image_url": {"url": data_url(b"nope")}}])
    template_parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image"},
        {"type": "text", "text": "with"},
        {"type": "image"},
    ]
    expected = transformers_reply(checkpoint, template_parts, images, 6)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage.prompt_tokens > 100  # the images' tokens count
    assert other.choices[0].message.content != reply.choices[0].message.content


def test_a_text_model_refuses_images(smollm2_engine):
    config = AppConfig.model_validate({"models": [{"name": MODEL}]})
    content = [{"type": "image_url", "image_url": {"url": data_url(picture(3, (32, 32)))}}]
    refused = pytest.raises(openai.BadRequestError, match="does not read images")
    with local_app(config, smollm2_engine) as (app, _), refused:
        chat(app, MODEL, content)


def test_anthropic_image_blocks_are_read_as_openai_image_parts(checkpoint):
    import anthropic

    config = AppConfig.model_validate(
        {"models": [{"name": VLM, "engine": {"model": str(checkpoint)}}]}
    )
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    image = picture(4, (80, 100))
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(image).decode(),
        },
    }
    parts = [{"type": "text", "text": "Describe"}, block]

    async def ask(app, content):  # noqa: ANN001, ANN202
        import httpx2  # anthropic 2 speaks through httpx2, with its own ASGI transport

        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://localhost") as http:
            client = anthropic.AsyncAnthropic(
                base_url="http://localhost", api_key="x", http_client=http
            )
            counted = await client.messages.count_tokens(
                model=VLM, messages=[{"role": "user", "content": content}]
            )
            reply = await client.messages.create(
                model=VLM,
                max_tokens=6,
                messages=[{"role": "user", "content": content}],
                extra_body={"temperature": 0},
            )
            return counted.input_tokens, reply

    with local_app(config, engine) as (app, _):
        counted, reply = run(ask(app, parts))
        openai_reply = chat(
            app, VLM, [parts[0], {"type": "image_url", "image_url": {"url": data_url(image)}}]
        )
    assert counted == openai_reply.usage.prompt_tokens > 100
    assert reply.content[0].text == openai_reply.choices[0].message.content


def test_ollama_images_are_read_as_openai_image_parts(checkpoint):
    import httpx
    import ollama

    config = AppConfig.model_validate(
        {"models": [{"name": VLM, "engine": {"model": str(checkpoint)}}]}
    )
    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    image = picture(5, (80, 100))
    options = {"temperature": 0, "num_predict": 6}

    async def ask(app):  # noqa: ANN001, ANN202
        transport = httpx.ASGITransport(app=app)
        client = ollama.AsyncClient(host="http://localhost", transport=transport)
        chatted = await client.chat(
            model=VLM,
            messages=[{"role": "user", "content": "Describe", "images": [image]}],
            options=options,
        )
        generated = await client.generate(
            model=VLM, prompt="Describe", images=[image], options=options
        )
        shown = await client.show(VLM)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            listed = (await http.get("/v1/models")).json()["models"]
            props = (await http.get("/props")).json()
            body = {"model": VLM, "prompt": "And?", "context": [1, 2], "stream": False}
            with_context = await http.post(
                "/api/generate", json={**body, "images": [base64.b64encode(image).decode()]}
            )
        assert with_context.status_code == 400, with_context.text
        return chatted, generated, shown, listed, props

    with local_app(config, engine) as (app, _):
        chatted, generated, shown, listed, props = run(ask(app))
        openai_reply = chat(
            app,
            VLM,
            [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": "Describe"},
            ],
        )
    assert "vision" in shown.capabilities
    assert "vision" in next(m for m in listed if m["name"] == VLM)["capabilities"]
    assert props["modalities"]["vision"] is True
    expected = openai_reply.choices[0].message.content
    assert chatted.message.content == generated.response == expected
    assert chatted.prompt_eval_count == openai_reply.usage.prompt_tokens > 100
