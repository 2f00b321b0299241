"""OpenAI's /v1/chat/completions (and /chat/completions): messages through the chat
template (the model's, or the request's own with its variables), tools, structured
outputs, and the assistant's message or its stream of deltas with tool calls read out
of the text. A reasoning model's thinking comes apart from its answer, as vLLM sends it:
`reasoning_content` beside `content`, whole and in deltas; calls, structured outputs
and stop strings apply to the answer."""

from collections.abc import AsyncIterator

from fastapi import APIRouter

from app.text.tool_calls import ToolFormat
from app.text.tool_stream import CallFragment, ToolCallStream, whole_output
from deployments.api.openai.routes import WIRE, response_head, token_text, usage_of
from deployments.api.openai.schema import ChatCompletionRequest, sampling_params
from deployments.api.slots import check_slot
from deployments.http.chat_turn import ChatTurn, prepare, start
from deployments.http.generation import Generation, OutputState, TextDelta
from deployments.http.streaming import stream
from deployments.ingress import Ingress, IngressDep, RequestTag

router = APIRouter()


# llama-server's /apply-template takes this dialect's chat body and answers the prompt that
# /v1/chat/completions would feed the model: it lives beside that route.
@router.post("/apply-template")
async def apply_template(req: ChatCompletionRequest, ingress: IngressDep) -> dict:
    """The prompt /v1/chat/completions would feed the model, as text."""
    name = ingress.served_name(req.model)
    messages, tools = req.template_messages(), req.template_tools()
    args = req.template_args()
    prompt = await ingress.chat_prompt(name, messages, tools, req.prompt_ending, args)
    return {"prompt": prompt}


async def input_tokens(req: ChatCompletionRequest, ingress: IngressDep) -> dict:
    """llama-server's count of the prompt tokens a chat request would take, images
    included, without running it."""
    prepared = await prepare(ingress, _turn(ingress, req))
    return {"input_tokens": len(prepared.prompt_ids), "object": "response.input_tokens"}


def _turn(ingress: Ingress, req: ChatCompletionRequest) -> ChatTurn:
    req.model = ingress.served_name(req.model)
    num_lp = (req.top_logprobs or 0) if req.logprobs else None
    return ChatTurn(
        req.model,
        req.template_messages(),
        sampling_params(req, ingress.config.max_tokens_default, num_lp),
        req.output_constraint(),
        **req.turn_tools(),
        template_args=req.template_args(),
        ending=req.prompt_ending,
        stop_strings=req.stop_strings,
    )


async def chat(req: ChatCompletionRequest, ingress: IngressDep, tag: RequestTag):  # noqa: ANN201
    turn = _turn(ingress, req)
    check_slot(ingress, req.model, req.id_slot, allow_any=True)
    gen, prepared = await start(ingress, turn, tag)
    fmt = prepared.tool_format
    if req.stream:
        return stream(gen, _chat_chunks(ingress, req, gen, fmt), WIRE)
    await gen.drain()
    choices = []
    for out in gen.outputs:
        message, reason = _chat_message(out, fmt)
        choice = {
            "index": out.index,
            "message": message,
            "finish_reason": reason,
            "logprobs": None,
        }
        if req.logprobs:
            choice["logprobs"] = {"content": _chat_logprobs(ingress, req.model, out.logprobs)}
        choices.append(choice)
    head = response_head(gen, req.model, "chatcmpl", "chat.completion")
    # timings: llama.cpp's extension (the prompt's and the generation's speed).
    return {**head, "choices": choices, "usage": usage_of(gen), "timings": gen.timings()}


for _prefix in ("/v1", ""):
    router.add_api_route(f"{_prefix}/chat/completions", chat, methods=["POST"])
    router.add_api_route(f"{_prefix}/chat/completions/input_tokens", input_tokens, methods=["POST"])


def _chat_logprobs(ingress: Ingress, model: str, lps: list) -> list[dict]:
    out = []
    for lp in lps:
        tok = token_text(ingress, model, lp.token_id)
        top = []
        for i, v in lp.top:
            t = token_text(ingress, model, i)
            top.append({"token": t, "logprob": v, "bytes": list(t.encode())})
        out.append(
            {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()), "top_logprobs": top}
        )
    return out


def _chat_message(out: OutputState, fmt: ToolFormat | None) -> tuple[dict, str | None]:
    """A finished output as an assistant message, with its thinking apart and its tool
    calls read out of its answer."""
    finish_reason = out.finish_reason
    message: dict = {"role": "assistant", "content": out.text}
    if out.reasoned:
        message["reasoning_content"] = out.thinking
    if fmt is None:
        return message, finish_reason
    content, calls = whole_output(fmt, out.text)
    message["content"] = content
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in calls
        ]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason


async def _chat_chunks(
    ingress: Ingress, req: ChatCompletionRequest, gen: Generation, fmt: ToolFormat | None
) -> AsyncIterator[dict]:
    head = response_head(gen, req.model, "chatcmpl", "chat.completion.chunk")
    calls = [ToolCallStream(fmt) for _ in range(req.n)] if fmt is not None else None
    for i in range(req.n):
        delta = {"role": "assistant", "content": ""}
        choice = {"index": i, "delta": delta, "finish_reason": None, "logprobs": None}
        if req.return_progress:  # llama.cpp's: how much of the prompt was cached
            yield {**head, "choices": [choice], "prompt_progress": gen.prompt_progress()}
        else:
            yield {**head, "choices": [choice]}
    async for d in gen.deltas():
        choice = _chat_delta(ingress, req, d, None if calls is None else calls[d.index])
        if choice is None:
            continue
        if choice["finish_reason"] is None and not req.timings_per_token:
            yield {**head, "choices": [choice]}
        else:  # an output's last chunk carries llama.cpp's timings, as llama.cpp's does
            yield {**head, "choices": [choice], "timings": gen.timings()}
    if req.stream_options and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": usage_of(gen)}


def _chat_delta(
    ingress: Ingress, req: ChatCompletionRequest, d: TextDelta, calls: ToolCallStream | None
) -> dict | None:
    delta: dict = {"content": d.text} if d.text else {}
    reason = d.finish_reason
    if calls is not None:
        content, fragments = calls.feed(d.text, final=reason is not None)
        delta = {"content": content} if content else {}
        if fragments:
            delta["tool_calls"] = [_call_fragment(f) for f in fragments]
        if calls.has_calls and reason == "stop":
            reason = "tool_calls"
    if d.thinking:
        delta = {"reasoning_content": d.thinking, **delta}
    if not delta and reason is None and not (req.logprobs and d.logprobs):
        return None  # held back: it may be the start of a call, or of a marker
    choice = {
        "index": d.index,
        "delta": delta,
        "finish_reason": reason,
        "logprobs": None,
    }
    if req.logprobs and d.logprobs:
        choice["logprobs"] = {"content": _chat_logprobs(ingress, req.model, d.logprobs)}
    return choice


def _call_fragment(f: CallFragment) -> dict:
    """A tool call delta as the SDK reassembles it: id, type and name first, then
    argument pieces under the same index."""
    if f.id is None:
        return {"index": f.index, "function": {"arguments": f.arguments}}
    function = {"name": f.name, "arguments": f.arguments}
    return {"index": f.index, "id": f.id, "type": "function", "function": function}
