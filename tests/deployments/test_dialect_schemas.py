"""Each dialect's schema -> neutral SamplingParams, with errors in the dialect's names."""

import pytest
from pydantic import ValidationError

from app.protocol.errors import InvalidRequestError
from deployments.api.llamacpp.schema import LlamaCompletionRequest
from deployments.api.ollama.schema import OllamaChatRequest, OllamaOptions
from deployments.api.openai.schema import ChatCompletionRequest, CompletionRequest, sampling_params
from deployments.api.parrot.schema import FillRequest, ParrotGenerateRequest
from deployments.api.responses.schema import ResponsesRequest


def test_ollama_defaults_and_names():
    params = OllamaOptions().sampling(default_max_tokens=99)
    assert (params.max_tokens, params.temperature, params.top_k) == (99, 0.8, 40)
    assert (params.top_p, params.repetition_penalty) == (0.9, 1.1)
    assert OllamaOptions(num_predict=-1).sampling(7).max_tokens == 7
    with pytest.raises(InvalidRequestError) as bad:
        OllamaOptions(top_p=3).sampling(8)
    assert bad.value.param == "options.top_p"
    assert OllamaOptions(stop="x").stop_strings == ["x"]


def test_ollama_refuses_what_it_cannot_honour():
    assert OllamaChatRequest(model="m", format="json").constraint().kind == "json"
    with pytest.raises(InvalidRequestError) as bad:
        OllamaChatRequest(model="m", format="xml").constraint()
    assert bad.value.param == "format"
    # think reaches the template as enable_thinking (a level as reasoning_effort too).
    assert OllamaChatRequest(model="m").template_args() is None
    assert OllamaChatRequest(model="m", think=False).template_args().variables == {
        "enable_thinking": False
    }
    assert OllamaChatRequest(model="m", think="high").template_args().variables == {
        "enable_thinking": True,
        "reasoning_effort": "high",
    }
    with pytest.raises(InvalidRequestError) as level:
        OllamaChatRequest(model="m", think="max").template_args()
    assert level.value.param == "think"


def test_llamacpp_fields_map_onto_sampling():
    req = LlamaCompletionRequest(prompt="x", n_predict=-1, seed=-1, repeat_penalty=1.2)
    params = req.params(default_max_tokens=50)
    assert params.max_tokens == 50 and params.seed is None and params.repetition_penalty == 1.2
    with pytest.raises(InvalidRequestError) as bad:
        LlamaCompletionRequest(n_predict=4, top_p=5).params(50)
    assert bad.value.param == "top_p"


def test_openai_is_strict_and_names_fields():
    with pytest.raises(InvalidRequestError) as unsupported:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{}]}
        )
    assert unsupported.value.param == "functions"
    with pytest.raises(ValidationError):  # unknown field: extra=forbid
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "nme": 1})
    req = CompletionRequest(model="m", prompt="x", logit_bias={"a": 1.0})
    with pytest.raises(InvalidRequestError) as bias:
        sampling_params(req, 16, None)
    assert bias.value.param == "logit_bias"
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}
    )
    with pytest.raises(InvalidRequestError) as tokens:
        sampling_params(chat, 16, None)
    assert tokens.value.param == "max_completion_tokens"


def test_parrot_ids_are_integers_and_fills_have_one_content():
    with pytest.raises(ValidationError):
        FillRequest.model_validate({"session_id": 1, "task_id": 1, "context_id": "7", "text": "a"})
    with pytest.raises(ValidationError):
        FillRequest(session_id=1, task_id=1, context_id=7, text="a", token_ids=[1])
    req = ParrotGenerateRequest(session_id=1, task_id=2, context_id=8, parent_context_id=7)
    assert (req.context_key, req.parent_key) == ("8", "7")
    assert req.sampling_config.params().max_tokens == 128


def test_responses_reasoning_items_go_with_the_assistant_turn_after_them():
    """A client that keeps its own context sends the reasoning items back: their text
    reaches the template as the next assistant message's reasoning_content."""
    thought = {"type": "reasoning", "id": "rs_1", "summary": []}
    items = [
        {"role": "user", "content": "Hi"},
        {**thought, "content": [{"type": "reasoning_text", "text": "A greeting."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello"}],
        },
        {"role": "user", "content": "Weather?"},
        {**thought, "summary": [{"type": "summary_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
    ]
    messages = ResponsesRequest(input=items).input_messages()
    assert [m.get("reasoning_content") for m in messages] == [
        None,
        "A greeting.",
        None,
        "Use the tool.",
    ]
    with pytest.raises(InvalidRequestError):
        ResponsesRequest(input=[{"type": "reasoning", "content": "x"}]).input_messages()
