"""A request's own chat template: rendered in the child as transformers renders it in
process, its variables reaching it, and its failures (a syntax error, raise_exception,
a runaway loop, a memory bomb, a reserved variable) refused as the client's, after
which the next render works."""

import time

import pytest

from app.protocol.errors import InvalidRequestError
from app.protocol.messages import TemplateArgs
from app.text import request_template
from app.text.tokenizer import chat_prompt

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_renders_as_transformers_does_in_process(smollm2_tokenizer):
    for ending in ("reply", "continue", "none"):
        for variables in ({}, {"enable_thinking": False}):
            args = TemplateArgs(CHATML, variables)
            own = chat_prompt(smollm2_tokenizer, MESSAGES, None, ending, args)
            expected = smollm2_tokenizer.apply_chat_template(
                MESSAGES,
                chat_template=CHATML,
                add_generation_prompt=ending == "reply",
                continue_final_message=ending == "continue",
                tokenize=False,
                **variables,
            )
            assert own == expected
    reply = chat_prompt(smollm2_tokenizer, MESSAGES, None, "reply", TemplateArgs(CHATML))
    assert reply.endswith("<|im_start|>assistant\n<think>\n")


def test_variables_reach_the_models_own_template_too(smollm2_tokenizer):
    args = TemplateArgs(None, {"enable_thinking": False})  # SmolLM2's ignores it
    plain = chat_prompt(smollm2_tokenizer, MESSAGES[:1])
    assert chat_prompt(smollm2_tokenizer, MESSAGES[:1], None, "reply", args) == plain
    with pytest.raises(InvalidRequestError) as reserved:
        chat_prompt(smollm2_tokenizer, MESSAGES, None, "reply", TemplateArgs(None, {"tokenize": 1}))
    assert reserved.value.param == "chat_template_kwargs"


def _refused(tokenizer, template: str) -> str:  # noqa: ANN001
    with pytest.raises(InvalidRequestError) as refused:
        chat_prompt(tokenizer, MESSAGES, None, "reply", TemplateArgs(template))
    assert refused.value.status_code == 400
    return refused.value.message


def test_failures_are_the_clients_and_the_child_recovers(smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(request_template, "RENDER_TIMEOUT_S", 1.0)
    assert "TemplateSyntaxError" in _refused(smollm2_tokenizer, "{% for %}")
    assert "no system role" in _refused(
        smollm2_tokenizer, "{{ raise_exception('no system role') }}"
    )
    started = time.perf_counter()
    loop = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    assert "ran over 1 s" in _refused(smollm2_tokenizer, loop)
    assert time.perf_counter() - started < 10
    assert "memory" in _refused(smollm2_tokenizer, "{{ 'x' * 4000000000 }}")
    # The killed child was replaced: the next template renders.
    assert (
        chat_prompt(smollm2_tokenizer, MESSAGES, None, "none", TemplateArgs("{{ 1 + 1 }}")) == "2"
    )
