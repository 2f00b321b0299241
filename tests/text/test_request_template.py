"""Chat templates rendered apart (a request's own, a downloaded model's): in a worker as
transformers renders them in process, their variables reaching them, their failures (a
syntax error, raise_exception, a runaway loop, a memory bomb, a reserved variable)
refused as the client's, after which the next render works; their output bounded by the
model's context in characters and tokens; and the workers shared fairly: one client's
runaways never hold up another client's render, and the waiting line is bounded (429)."""

import contextlib
import threading
import time
from typing import Any

import pytest

from app.protocol.errors import InvalidRequestError
from app.protocol.messages import RenderLimits, TemplateArgs
from app.text.render_pool import RenderPool, Sandbox
from app.text.request_template import RenderersBusyError
from app.text.tokenizer import chat_prompt, chat_token_ids

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
RUNAWAY = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


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


def test_a_downloaded_models_own_template_renders_apart_as_in_process(smollm2_tokenizer):
    """A model started at run time (`model_template`): its own template, and the one that
    renders its tools, in the worker, with the text and ids it gets in process."""
    sandbox = Sandbox(RenderPool(workers=1), RenderLimits("a", 8192), model_template=True)
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    called = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},  # None: as if absent
        {"role": "tool", "content": "1"},
    ]
    for messages, tools in ((MESSAGES[:1], None), (MESSAGES[:1], TOOLS), (called, None)):
        apart = chat_prompt(smollm2_tokenizer, messages, tools, "reply", None, sandbox)
        assert apart == chat_prompt(smollm2_tokenizer, messages, tools)
        ids = chat_token_ids(smollm2_tokenizer, messages, tools, "reply", None, sandbox)
        assert ids == chat_token_ids(smollm2_tokenizer, messages, tools)
    # Its template is not the operator's: a runaway one is cut off, not run in process.
    runaway = Sandbox(RenderPool(workers=1, timeout_s=1.0), model_template=True)
    with _model_template(smollm2_tokenizer, RUNAWAY), pytest.raises(InvalidRequestError) as out:
        chat_prompt(smollm2_tokenizer, MESSAGES, None, "reply", None, runaway)
    assert "ran over 1 s" in out.value.message and out.value.param == "messages"


def test_variables_reach_the_models_own_template_too(smollm2_tokenizer):
    args = TemplateArgs(None, {"enable_thinking": False})  # SmolLM2's ignores it
    plain = chat_prompt(smollm2_tokenizer, MESSAGES[:1])
    assert chat_prompt(smollm2_tokenizer, MESSAGES[:1], None, "reply", args) == plain
    with pytest.raises(InvalidRequestError) as reserved:
        chat_prompt(smollm2_tokenizer, MESSAGES, None, "reply", TemplateArgs(None, {"tokenize": 1}))
    assert reserved.value.param == "chat_template_kwargs"


def _refused(tokenizer: Any, template: str, sandbox: Sandbox | None = None) -> str:
    with pytest.raises(InvalidRequestError) as refused:
        chat_token_ids(tokenizer, MESSAGES, None, "none", TemplateArgs(template), sandbox)
    assert refused.value.status_code == 400 and refused.value.param == "chat_template"
    return refused.value.message


def test_failures_are_the_clients_and_the_worker_recovers(smollm2_tokenizer):
    sandbox = Sandbox(RenderPool(workers=1, timeout_s=1.0))
    assert "TemplateSyntaxError" in _refused(smollm2_tokenizer, "{% for %}", sandbox)
    assert "no system role" in _refused(
        smollm2_tokenizer, "{{ raise_exception('no system role') }}", sandbox
    )
    started = time.perf_counter()
    assert "ran over 1 s" in _refused(smollm2_tokenizer, RUNAWAY, sandbox)
    assert time.perf_counter() - started < 10
    first = _worker_pid(sandbox.pool)
    assert "memory" in _refused(smollm2_tokenizer, "{{ 'x' * 4000000000 }}", sandbox)
    # The killed worker, and the one that ran out of memory, were replaced: the next
    # template renders, in a new worker.
    two = chat_prompt(
        smollm2_tokenizer, MESSAGES, None, "none", TemplateArgs("{{ 1 + 1 }}"), sandbox
    )
    assert two == "2" and _worker_pid(sandbox.pool) != first


def test_the_output_is_bounded_by_the_context_in_characters_and_tokens(smollm2_tokenizer):
    """Counted in the worker, with the model's own tokenizer (the count is the one the
    ids have), so no more than a context's worth of text comes out to be encoded; for
    a tokenizer the worker cannot load, the ids are counted outside, from text bounded
    in characters."""
    sandbox = Sandbox(RenderPool(workers=1), RenderLimits("a", 50))
    counting = _Counting(smollm2_tokenizer)
    ids = chat_token_ids(
        counting, MESSAGES, None, "none", TemplateArgs("{{ 'hi ' * 40 }}"), sandbox
    )
    assert 40 <= len(ids) <= 50 and counting.encoded == [120]
    expected = len(smollm2_tokenizer("hello " * 100, add_special_tokens=False).input_ids)
    assert _refused(counting, "{{ 'hello ' * 100 }}", sandbox) == (
        f"chat template failed: it rendered {expected} tokens; the model's context holds 50"
    )
    assert "over 3200 characters, more than the model's context (50 tokens)" in _refused(
        counting, "{{ 'hello ' * 10000 }}", sandbox
    )
    assert counting.encoded == [120]  # the overruns' text never came out to be encoded
    assert f"it rendered {expected} tokens" in _refused(
        _NoBackend(smollm2_tokenizer), "{{ 'hello ' * 100 }}", sandbox
    )
    with pytest.raises(InvalidRequestError) as text_only:  # /apply-template's text too
        args = TemplateArgs("{{ 'hello ' * 100 }}")
        chat_prompt(_NoBackend(smollm2_tokenizer), MESSAGES, None, "none", args, sandbox)
    assert f"it rendered {expected} tokens" in text_only.value.message


def test_one_clients_runaways_leave_a_worker_to_the_others(smollm2_tokenizer):
    """Client a's runaways take one worker at most (and its cap of renders in all: the
    rest are refused at once); b's renders start at once meanwhile, every time."""
    pool = RenderPool(workers=2, max_queued_per_client=3, timeout_s=0.5)
    _render(pool, smollm2_tokenizer, "{{ 'warm' }}", "b")  # starts the workers
    outcomes: list[str] = []
    threads = [
        threading.Thread(target=lambda: outcomes.append(_outcome(pool, smollm2_tokenizer, "a")))
        for _ in range(5)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    waits = []
    for _ in range(10):
        started = time.perf_counter()
        assert _render(pool, smollm2_tokenizer, "{{ 'ok' }}", "b") == "ok"
        waits.append(time.perf_counter() - started)
        time.sleep(0.2)
    for thread in threads:
        thread.join()
    assert max(waits) < 0.5, waits
    assert sorted(outcomes) == ["busy", "busy", "ran over", "ran over", "ran over"]


def test_a_free_worker_goes_to_the_client_served_least_recently(smollm2_tokenizer):
    """One worker, client a's three runaways in line first: b's render, come later, goes
    right after a's first, not after all three."""
    pool = RenderPool(workers=1, timeout_s=0.5)
    _render(pool, smollm2_tokenizer, "{{ 'warm' }}", "b")
    done: dict[str, float] = {}
    started = time.perf_counter()

    def run(name: str, client: str, template: str) -> None:
        with contextlib.suppress(InvalidRequestError):
            _render(pool, smollm2_tokenizer, template, client)
        done[name] = time.perf_counter() - started

    threads = [threading.Thread(target=run, args=(f"a{i}", "a", RUNAWAY)) for i in range(3)]
    threads.append(threading.Thread(target=run, args=("b", "b", "{{ 'ok' }}")))
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    assert done["a0"] < done["b"] < done["a1"] < done["a2"], done


def test_the_waiting_line_is_bounded(smollm2_tokenizer):
    pool = RenderPool(workers=1, max_queued=1, timeout_s=0.5)
    _render(pool, smollm2_tokenizer, "{{ 'warm' }}", "a")
    threads = [
        threading.Thread(target=_outcome, args=(pool, smollm2_tokenizer, client))
        for client in ("a", "b")  # one running, one waiting
    ]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    with pytest.raises(RenderersBusyError) as busy:
        _render(pool, smollm2_tokenizer, "{{ 'ok' }}", "c")
    assert busy.value.status_code == 429 and busy.value.retry_after_s
    assert "1 renders are waiting" in busy.value.message
    for thread in threads:
        thread.join()
    assert _render(pool, smollm2_tokenizer, "{{ 'ok' }}", "c") == "ok"


def test_a_full_line_makes_room_for_a_client_with_none_waiting(smollm2_tokenizer):
    """Client a fills the line (two waiting behind its running one; a third is refused);
    b's render then takes the place of a's newest, and goes next."""
    pool = RenderPool(workers=1, max_queued=2, timeout_s=0.5)
    _render(pool, smollm2_tokenizer, "{{ 'warm' }}", "b")
    done: dict[str, tuple[float, str]] = {}
    started = time.perf_counter()

    def run(name: str, client: str, template: str) -> None:
        try:
            outcome = _render(pool, smollm2_tokenizer, template, client)
        except RenderersBusyError:
            outcome = "busy"
        except InvalidRequestError:
            outcome = "ran over"
        done[name] = (time.perf_counter() - started, outcome)

    names = [("a0", "a", RUNAWAY), ("a1", "a", RUNAWAY), ("a2", "a", RUNAWAY)]
    names += [("a3", "a", RUNAWAY), ("b", "b", "{{ 'ok' }}")]
    threads = [threading.Thread(target=run, args=args) for args in names]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    outcomes = {name: outcome for name, (_, outcome) in done.items()}
    assert outcomes == {"a0": "ran over", "a1": "ran over", "a2": "busy", "a3": "busy", "b": "ok"}
    assert done["a0"][0] < done["b"][0] < done["a1"][0], done


def test_a_client_with_several_renders_is_not_starved_by_two_runaways(smollm2_tokenizer):
    """Client a keeps two runaways outstanding, b six benign renders: a worker's turns
    go by the time each client took of it, so b (milliseconds a render) renders for as
    long as each of a's runaways took (its time limit and its worker's restart). By
    turns alone, b got one render per runaway of a's."""
    pool = RenderPool(workers=2, max_queued_per_client=8, timeout_s=0.5)
    _render(pool, smollm2_tokenizer, "{{ 'warm' }}", "b")
    deadline = time.perf_counter() + 30
    counts = {"a ran over": 0, "b rendered": 0}

    def going() -> bool:  # until a's third runaway was answered
        return counts["a ran over"] < 3 and time.perf_counter() < deadline

    def loop(client: str, template: str) -> None:
        while going():
            try:
                _render(pool, smollm2_tokenizer, template, client)
                counts[f"{client} rendered"] += 1
            except InvalidRequestError:
                counts[f"{client} ran over"] = counts.get(f"{client} ran over", 0) + 1

    threads = [threading.Thread(target=loop, args=("a", RUNAWAY)) for _ in range(2)]
    # b's renders: enough that b always has several here (with one, b's render would go
    # first as a client's only one, and a's next runaway could take the shared worker).
    threads += [threading.Thread(target=loop, args=("b", "{{ 'ok' }}")) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts["b rendered"] >= 10 * max(1, counts["a ran over"]), counts


def _worker_pid(pool: RenderPool) -> int:
    """The pid of the pool's one worker, once it is idle (a replacement has started)."""
    deadline = time.monotonic() + 30
    while not pool._idle and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.05)
    (slot,) = pool._idle  # noqa: SLF001
    assert slot.child is not None
    return slot.child.proc.pid


def _render(pool: RenderPool, tokenizer: Any, template: str, client: str) -> str:
    sandbox = Sandbox(pool, RenderLimits(client, 8192))
    return chat_prompt(tokenizer, MESSAGES, None, "none", TemplateArgs(template), sandbox)


def _outcome(pool: RenderPool, tokenizer: Any, client: str) -> str:
    try:
        _render(pool, tokenizer, RUNAWAY, client)
    except RenderersBusyError:
        return "busy"
    except InvalidRequestError as exc:
        return "ran over" if "ran over" in exc.message else exc.message
    return "rendered"


class _model_template:  # noqa: N801 (a context manager, named for what it does)
    def __init__(self, tokenizer: Any, template: str) -> None:
        self.tokenizer, self.template = tokenizer, template

    def __enter__(self) -> None:
        self.saved, self.tokenizer.chat_template = self.tokenizer.chat_template, self.template

    def __exit__(self, *exc: object) -> None:
        self.tokenizer.chat_template = self.saved


class _Counting:
    """A tokenizer that notes what it is asked to encode, here."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.special_tokens_map = tokenizer.special_tokens_map
        self.encoded: list[int] = []

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.encoded.append(len(text))
        return self._tokenizer(text, **kwargs)


class _NoBackend:
    """A tokenizer without a Rust backend to send to the worker."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.special_tokens_map = tokenizer.special_tokens_map

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)
