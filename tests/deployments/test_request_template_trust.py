"""Who may have a template rendered, and where: a request's own chat template is refused
(400, saying how to allow it) unless the config trusts them, while its variables are
data and go on; a model started at run time from a download renders its own template in
the Tokenizer's sandbox, not in its process; and the client a render is counted against
is the caller's key, else its address (ClientScope)."""

import asyncio

import pytest

from app.protocol.errors import InvalidRequestError
from app.protocol.messages import RenderLimits, TemplateArgs
from app.protocol.outputs import EngineInfo
from deployments.config import AppConfig, TemplateSandboxConfig
from deployments.http.app import create_app
from deployments.http.caller import Caller
from deployments.http.client_scope import ClientScope, current_client
from deployments.ingress import Ingress
from deployments.tokenizer import Tokenizer
from tests.local_app import LocalHandle, http_client, run

ASK = [{"role": "user", "content": "What is 2+2?"}]
RUNAWAY = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def test_a_request_template_is_refused_unless_trusted(app):
    """The default app (conftest's): off."""

    async def scenario():  # noqa: ANN202
        async with http_client(app) as http:
            own = {"messages": ASK, "chat_template": "{{ 'x' }}", "max_tokens": 1}
            refused = [
                await http.post(p, json=own) for p in ("/v1/chat/completions", "/apply-template")
            ]
            variables = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
            applied = await http.post("/apply-template", json=variables)
            return refused, applied

    refused, applied = run(scenario())
    for reply in refused:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]  # OpenAI's shape, as both routes answer
        assert error["param"] == "chat_template" and error["type"] == "invalid_request_error"
        assert "trust_request_chat_template: true" in error["message"]
    assert applied.status_code == 200 and applied.json()["prompt"].startswith("<|im_start|>")


@pytest.fixture(scope="module")
def config() -> AppConfig:
    return AppConfig.model_validate({"embeddings": {"enabled": False}})


def test_the_tokenizer_refuses_them_too_unless_trusted(config):
    name = config.models[0].name
    with pytest.raises(InvalidRequestError) as refused:
        Tokenizer(config.models).encode_chat(name, ASK, None, None, "reply", TemplateArgs("x"))
    assert refused.value.param == "chat_template"
    trusting = Tokenizer(config.models, trust_request_chat_template=True)
    assert trusting.chat_prompt(name, ASK, None, None, "none", TemplateArgs("{{ 'x' }}")) == "x"


def test_a_run_time_models_own_template_renders_in_the_sandbox(config):
    """The same weights started at run time under another name: the same prompt, but
    rendered apart, so a runaway template from its repo is cut off (in process it would
    hold the Tokenizer's thread for hours)."""
    configured = config.models[0]
    tokenizer = Tokenizer(config.models, sandbox=TemplateSandboxConfig(workers=1, timeout_s=1.0))
    source = configured.engine.model
    limits = RenderLimits("address:127.0.0.1", 8192)
    ids = tokenizer.encode_chat("downloaded", ASK, source, None, "reply", None, limits)
    assert ids == tokenizer.encode_chat(configured.name, ASK)
    tokenizer.runtime[f"downloaded@{source}"].chat_template = RUNAWAY
    with pytest.raises(InvalidRequestError) as cut:
        tokenizer.encode_chat("downloaded", ASK, source, None, "reply", None, limits)
    assert "ran over 1 s" in cut.value.message and cut.value.param == "messages"


@pytest.mark.parametrize(
    ("caller", "client", "expected"),
    [
        (Caller(key_id="k1"), ("10.0.0.1", 1), "key:k1"),
        (Caller(), ("10.0.0.2", 2), "address:10.0.0.2"),
        (None, ("10.0.0.3", 3), "address:10.0.0.3"),  # no keys: the guard found no caller
        (None, None, "address:"),
    ],
)
def test_the_client_is_the_callers_key_else_its_address(caller, client, expected):
    seen = []

    async def route(scope, receive, send):  # noqa: ANN001, ANN202
        seen.append(current_client())

    scope = {"type": "http", "client": client, "state": {"caller": caller}, "headers": []}
    asyncio.run(ClientScope(route)(scope, None, None))
    assert seen == [expected] and current_client() == ""


class _Model:
    """A model replica that only says what it is (all /apply-template asks of one)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def info(self) -> EngineInfo:
        return EngineInfo(self.name, 1024)


def test_each_key_is_a_client_of_its_own_with_the_models_context():
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "api_keys": ["key-one", "key-two"],
            "trust_request_chat_template": True,
        }
    )
    name = config.models[0].name
    tokenizer = Tokenizer(config.models, True)
    seen: list[RenderLimits] = []
    render = tokenizer.pool.render

    def noted(job, tokenizer=None, limits=None, param="chat_template"):  # noqa: ANN001, ANN202
        seen.append(limits)
        return render(job, tokenizer, limits, param)

    tokenizer.pool.render = noted
    ingress = Ingress(config, LocalHandle(tokenizer), {name: LocalHandle(_Model(name))})

    async def scenario():  # noqa: ANN202
        async with http_client(create_app(ingress)) as http:
            body = {"messages": ASK, "chat_template": "{{ 'x' }}"}
            for key in ("key-one", "key-two", "key-one"):
                headers = {"Authorization": f"Bearer {key}"}
                reply = await http.post("/apply-template", json=body, headers=headers)
                assert reply.json() == {"prompt": "x"}

    run(scenario())
    clients = [limits.client for limits in seen]
    assert clients[0] == clients[2] != clients[1] and clients[0].startswith("key:")
    assert {limits.max_prompt_tokens for limits in seen} == {1024}
