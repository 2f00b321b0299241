"""Images beyond OpenAI chat's data URLs, on a tiny random SmolVLM checkpoint through the
real routes and engine: image URLs fetched from a local image host (OpenAI image_url,
Anthropic url sources) give the reply their bytes give inline; Responses `input_image`
parts give chat's reply; llama.cpp's prompt objects put `multimodal_data` at their media
markers, token for token as transformers generates; /chat/completions/input_tokens
counts the image's tokens; a text model's refusal says image input is not supported."""

import base64
import io

import httpx
import openai
import pytest
import torch

from deployments.config import AppConfig
from tests.deployments.test_openai_images import VLM, data_url, picture
from tests.helpers import tiny_engine
from tests.image_host import image_host
from tests.local_app import MODEL, http_client, local_app, run
from tests.models.vision_checkpoints import (
    save_gemma3_vision_checkpoint,
    save_idefics3_checkpoint,
    save_qwen2_5_vl_checkpoint,
)

pytest.importorskip("PIL")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_idefics3_checkpoint(tmp_path_factory.mktemp("smolvlm"), processor=True)


def vlm_config(checkpoint, **images) -> AppConfig:  # noqa: ANN001, ANN003
    return AppConfig.model_validate(
        {"models": [{"name": VLM, "engine": {"model": str(checkpoint)}}], "images": images}
    )


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="x", http_client=http)


async def chat_text(http: httpx.AsyncClient, content: list) -> tuple[str, int]:
    reply = await openai_client(http).chat.completions.create(
        model=VLM, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
    )
    return reply.choices[0].message.content, reply.usage.prompt_tokens


def test_image_urls_give_what_their_bytes_give_inline(checkpoint):
    import anthropic
    import httpx2

    image = picture(11, (80, 100))
    question = {"type": "text", "text": "Describe"}

    async def go(app, base):  # noqa: ANN001, ANN202
        async with http_client(app) as http:
            inline = await chat_text(http, [question, _image_url(data_url(image))])
            fetched = await chat_text(http, [question, _image_url(f"{base}/a.png")])
            counted = await http.post(
                "/v1/chat/completions/input_tokens",
                json={"messages": [{"role": "user", "content": [question, _image_url(base)]}]},
            )
            missing = await http.post(
                "/v1/chat/completions/input_tokens",
                json={"messages": [{"role": "user", "content": [_image_url(f"{base}/b")]}]},
            )
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://localhost") as h2:
            client = anthropic.AsyncAnthropic(
                base_url="http://localhost", api_key="x", http_client=h2
            )
            block = {"type": "image", "source": {"type": "url", "url": f"{base}/a.png"}}
            told = await client.messages.create(
                model=VLM,
                max_tokens=6,
                messages=[{"role": "user", "content": [question, block]}],
                extra_body={"temperature": 0},
            )
        return inline, fetched, counted, missing, told.content[0].text

    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    with image_host({"/a.png": image}) as base:
        port = int(base.rsplit(":", 1)[1])
        config = vlm_config(
            checkpoint, allow_urls=True, url_private_hosts=["127.0.0.1"], url_ports=[port]
        )
        with local_app(config, engine) as (app, _):
            inline, fetched, counted, missing, told = run(go(app, base))
    assert fetched == inline and told == inline[0]
    assert counted.status_code == 400  # the host's root is no image
    assert missing.status_code == 400 and "HTTP 404" in missing.json()["error"]["message"]


def test_responses_input_image_parts_give_chats_reply(checkpoint):
    image = picture(12, (80, 100))
    url = data_url(image)

    async def go(app):  # noqa: ANN001, ANN202
        async with http_client(app) as http:
            client = openai_client(http)
            expected = await chat_text(
                http, [{"type": "text", "text": "Describe"}, _image_url(url)]
            )
            content = [
                {"type": "input_text", "text": "Describe"},
                {"type": "input_image", "image_url": url, "detail": "auto"},
            ]
            first = await client.responses.create(
                model=VLM,
                input=[{"role": "user", "content": content}],
                max_output_tokens=6,
                temperature=0,
            )
            listed = await client.responses.input_items.list(first.id)
            follow = await client.responses.create(
                model=VLM,
                previous_response_id=first.id,
                input="And?",
                max_output_tokens=3,
                temperature=0,
            )
            by_file = await http.post(
                "/v1/responses",
                json={
                    "model": VLM,
                    "input": [
                        {"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}
                    ],
                },
            )
            assistants = await http.post(
                "/v1/conversations",
                json={
                    "items": [
                        {
                            "role": "assistant",
                            "content": [{"type": "input_image", "image_url": url}],
                        }
                    ]
                },
            )
        assert assistants.status_code == 400, assistants.text  # images are user input
        return expected, first, listed, follow, by_file

    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    with local_app(vlm_config(checkpoint), engine) as (app, _):
        (text, prompt_tokens), first, listed, follow, by_file = run(go(app))
    assert first.output_text == text
    assert first.usage.input_tokens == prompt_tokens
    parts = listed.data[0].content
    assert parts[1].type == "input_image" and parts[1].image_url == url
    assert follow.usage.input_tokens > prompt_tokens  # the image is in the history still
    assert by_file.status_code == 400 and "file_id" in by_file.json()["error"]["message"]


def transformers_completion(checkpoint, text: str, image: bytes, n: int) -> tuple[list[int], int]:
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(checkpoint)
    picture_ = Image.open(io.BytesIO(image)).convert("RGB")
    inputs = processor(text=text, images=[[picture_]], return_tensors="pt")
    model = Idefics3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.eval().generate(**inputs, max_new_tokens=n, do_sample=False)
    prompt = inputs["input_ids"].shape[1]
    return out[0, prompt:].tolist(), prompt


def test_llamacpp_multimodal_data_stands_at_its_media_markers(checkpoint):
    image = picture(13, (80, 100))
    encoded = base64.b64encode(image).decode()

    async def go(app):  # noqa: ANN001, ANN202
        async with http_client(app) as http:
            props = (await http.get("/props")).json()
            marker = props["media_marker"]
            body = {"n_predict": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}
            prompt = {"prompt_string": f"What is this: {marker}\n", "multimodal_data": [encoded]}
            done = await http.post("/completion", json={**body, "prompt": prompt})
            many = {"prompt_string": f"{marker}", "multimodal_data": [encoded]}
            too_many = await http.post("/completion", json={**body, "prompt": [many] * 9})
            assert too_many.status_code == 400 and "at most 8" in too_many.text
            refused = [
                await http.post("/completion", json={**body, "prompt": p})
                for p in (
                    {"prompt_string": "What is this:\n", "multimodal_data": [encoded]},
                    {"prompt_string": f"{marker}", "multimodal_data": ["malformed"]},
                    {"prompt_string": "What is this:\n", "multimodal_data": [""]},
                )
            ]
            listed = (await http.get("/v1/models")).json()["models"]
        return props, done, refused, listed

    engine = tiny_engine(checkpoint, num_kv_blocks=256)
    with local_app(vlm_config(checkpoint), engine) as (app, _):
        props, done, refused, listed = run(go(app))
    assert done.status_code == 200, done.text
    expected, prompt_tokens = transformers_completion(
        checkpoint, "What is this: <image>\n", image, 6
    )
    assert done.json()["tokens"] == expected
    assert done.json()["tokens_evaluated"] == prompt_tokens
    assert [r.status_code for r in refused] == [400, 400, 400]
    assert "multimodal" in listed[0]["capabilities"]
    assert props["modalities"]["vision"] is True


def test_a_text_model_says_image_input_is_not_supported(smollm2_engine):
    """As llama.cpp's own suite checks: an image in an Anthropic tool result too."""
    config = AppConfig.model_validate({"models": [{"name": MODEL}]})
    source = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    messages = [
        {"role": "user", "content": "What is in this image?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [
                        {"type": "text", "text": "here"},
                        {"type": "image", "source": source},
                    ],
                }
            ],
        },
    ]
    tools = [{"name": "look", "description": "d", "input_schema": {"type": "object"}}]

    async def go(app):  # noqa: ANN001, ANN202
        async with http_client(app) as http:
            body = {"model": MODEL, "max_tokens": 4, "messages": messages, "tools": tools}
            return await http.post("/v1/messages", json=body)

    with local_app(config, smollm2_engine) as (app, _):
        answer = run(go(app))
    assert answer.status_code == 400
    assert "image input is not supported" in answer.json()["error"]["message"].lower()


def _image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_gemma3_reads_images_through_the_openai_route(tmp_path):
    """Gemma 3's processor and template behind the chat route: transformers' reply."""
    from tests.models.test_vision_gemma3 import transformers_run

    checkpoint = save_gemma3_vision_checkpoint(tmp_path)
    image = picture(14, (48, 64))
    parts = [{"type": "text", "text": "Describe"}, _image_url(data_url(image))]

    async def go(app):  # noqa: ANN001, ANN202
        async with http_client(app) as http:
            reply = await openai_client(http).chat.completions.create(
                model=VLM,
                messages=[{"role": "user", "content": parts}],
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            listed = (await http.get("/v1/models")).json()["models"]
        return reply, listed

    engine = tiny_engine(checkpoint, num_kv_blocks=128)
    with local_app(vlm_config(checkpoint), engine) as (app, _):
        reply, listed = run(go(app))
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": [parts[0], {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids, expected = transformers_run(checkpoint, text, [image])
    assert reply.choices[0].message.content == processor.tokenizer.decode(
        expected, skip_special_tokens=True
    )
    assert reply.usage.prompt_tokens == len(ids)
    assert "vision" in listed[0]["capabilities"]


def test_qwen2_5_vl_reads_images_through_the_openai_route(tmp_path):
    """Qwen2.5-VL's image processor and template behind the chat route (without
    transformers' processor class, which needs torchvision): transformers' reply."""
    from app.models.source import resolve_model
    from app.text.images import load_processor
    from tests.models.test_vision_qwen2_5_vl import prompt, transformers_greedy

    checkpoint = save_qwen2_5_vl_checkpoint(tmp_path)
    image = picture(15, (60, 90))
    parts = [{"type": "text", "text": "Describe"}, _image_url(data_url(image))]

    async def go(app):  # noqa: ANN001, ANN202
        async with http_client(app) as http:
            return await openai_client(http).chat.completions.create(
                model=VLM,
                messages=[{"role": "user", "content": parts}],
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )

    engine = tiny_engine(checkpoint, num_kv_blocks=128)
    with local_app(vlm_config(checkpoint), engine) as (app, _):
        reply = run(go(app))
    processor = load_processor(resolve_model(str(checkpoint)))
    ids, inputs = prompt(processor, ["Describe", None], [image])
    expected = transformers_greedy(checkpoint, ids, inputs)
    text = processor.tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == len(ids)
