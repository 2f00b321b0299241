"""Constrained decoding in the engine, on the real default model: every output matches
its constraint through forks, seeds, chunked prefill, prefix caching, preemption and
persistent contexts; a bad constraint is refused before it is queued."""

import json

import jsonschema
import pytest

from app.engine import EngineConfig, LLMEngine
from app.protocol import InvalidRequestError, SamplingParams
from app.protocol.messages import ContextAction, ContextOp
from app.protocol.sampling import Constraint
from app.text.tokenizer import chat_token_ids

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
JSON = Constraint(kind="json", spec=json.dumps(SCHEMA))
YES_NO = Constraint(kind="choice", spec='["yes", "no"]')


def engine_like(base: LLMEngine, **config) -> LLMEngine:  # noqa: ANN003
    """An engine on `base`'s weights with its own cache and config."""
    defaults = {"dtype": "float32", "num_threads": 2}
    return LLMEngine(EngineConfig(**(defaults | config)), loaded=base.loaded)


def prompt(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return chat_token_ids(tokenizer, [{"role": "user", "content": text}])


def texts(tokenizer, result) -> list[str]:  # noqa: ANN001
    return [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in result.outputs]


def test_forks_and_seeds(smollm2_engine, smollm2_tokenizer):
    ids = prompt(smollm2_tokenizer, "Describe someone as JSON.")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60, constraint=JSON)
    first = smollm2_engine.generate([ids], params)[0]
    again = smollm2_engine.generate([ids], params)[0]
    for out in first.outputs:
        assert out.finish_reason.value == "stop"
    for text in texts(smollm2_tokenizer, first):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert texts(smollm2_tokenizer, again) == texts(smollm2_tokenizer, first)  # seeded


def test_chunked_prefill_and_prefix_cache(smollm2_engine, smollm2_tokenizer):
    engine = engine_like(smollm2_engine, max_num_batched_tokens=32, num_kv_blocks=64)
    long = "Here is some context about a person. " * 8 + "Describe them as JSON."
    ids = prompt(smollm2_tokenizer, long)
    params = SamplingParams(temperature=0, max_tokens=60, constraint=JSON)
    cold = engine.generate([ids], params)[0]
    warm = engine.generate([ids], params)[0]
    assert len(ids) > 64 and engine.stats_snapshot()["prefix_cache_hit_tokens"] > 0
    assert texts(smollm2_tokenizer, warm) == texts(smollm2_tokenizer, cold)
    jsonschema.validate(json.loads(texts(smollm2_tokenizer, cold)[0]), SCHEMA)


def test_preempted_sequences_keep_their_grammar(smollm2_engine, smollm2_tokenizer):
    engine = engine_like(smollm2_engine, num_kv_blocks=12, block_size=16, max_num_seqs=8)
    prompts = [prompt(smollm2_tokenizer, f"Person number {i} as JSON.") for i in range(6)]
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=60, constraint=JSON)
    results = engine.generate(prompts, params)
    assert engine.stats_snapshot()["num_preemptions"] > 0
    for result in results:
        jsonschema.validate(json.loads(texts(smollm2_tokenizer, result)[0]), SCHEMA)


def test_a_choice_ends_without_an_eos_step_and_beats_logit_bias(smollm2_engine, smollm2_tokenizer):
    ids = prompt(smollm2_tokenizer, "Is water wet?")
    maybe = smollm2_tokenizer.encode("maybe", add_special_tokens=False)[0]
    params = SamplingParams(
        temperature=0, max_tokens=10, constraint=YES_NO, logit_bias={maybe: 100}
    )
    out = smollm2_engine.generate([ids], params)[0].outputs[0]
    assert smollm2_tokenizer.decode(out.token_ids) in ("yes", "no")  # no EOS token in it
    assert out.finish_reason.value == "stop"


def test_a_context_generation_is_constrained(smollm2_engine, smollm2_tokenizer):
    engine = engine_like(smollm2_engine, num_kv_blocks=64)
    ids = prompt(smollm2_tokenizer, "Is fire hot?")
    op = ContextOp("ctx-grammar", ContextAction.GENERATE)
    engine.add_request(
        "r1", ids, SamplingParams(temperature=0, max_tokens=10, constraint=YES_NO), op
    )
    deltas = []
    while engine.has_work:
        deltas += engine.step()
    output = [t for d in deltas for t in d.token_ids]
    assert smollm2_tokenizer.decode(output) in ("yes", "no")
    assert engine.context_tokens("ctx-grammar") == ids + output


@pytest.mark.parametrize(
    "constraint, words",
    [
        (Constraint(kind="json", spec="{"), "json"),
        (Constraint(kind="json", spec='{"type": "nonsense"}'), "nonsense"),
        (Constraint(kind="regex", spec="(unclosed"), "regex"),
        (Constraint(kind="grammar", spec="root ::= missing"), "missing"),
        (Constraint(kind="choice", spec="[]"), "choice"),
        (Constraint(kind="lark", spec="start: %json {"), "lark"),
    ],
)
def test_bad_constraints_are_refused_before_queueing(smollm2_engine, constraint, words):
    with pytest.raises(InvalidRequestError, match=words):
        smollm2_engine.add_request("bad", [1, 2, 3], SamplingParams(constraint=constraint))
    assert "bad" not in smollm2_engine.requests


def test_turned_off(smollm2_engine):
    engine = engine_like(smollm2_engine, num_kv_blocks=8, structured_outputs=False)
    with pytest.raises(InvalidRequestError, match="turned off"):
        engine.add_request("x", [1, 2, 3], SamplingParams(constraint=YES_NO))
