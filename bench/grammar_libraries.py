"""Grammar libraries side by side on the default model's vocabulary: llguidance (what
the engine uses) and xgrammar, when it is installed (`pip install --no-deps xgrammar
apache-tvm-ffi`; it is not a dependency).

For each: the time to compile 20 varied JSON schemas (cold), and the time to fill the
token masks of 32 sequences per step while each follows its own JSON document, under
one schema and under "any JSON object". The last line printed is a JSON object.

    .venv/bin/python bench/grammar_libraries.py
"""

import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "Paris",
    "café",
    "naïve",
    "東京",
    "🎉",
    '"quoted"',
    "back\\slash",
]


def documents(rng: random.Random, n: int) -> list[dict]:
    return [
        {
            "name": " ".join(rng.choice(WORDS) for _ in range(8)),
            "age": rng.randint(0, 99),
            "email": f"user{i}@example.com",
            "tags": [rng.choice(WORDS) for _ in range(3)],
            "address": {"city": rng.choice(WORDS), "zip": f"{rng.randint(0, 99999):05d}"},
            "role": rng.choice(["admin", "user", "guest"]),
        }
        for i in range(n)
    ]


def schemas(rng: random.Random, n: int) -> list[dict]:
    kinds = [
        {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
        {"type": "array", "items": {"type": "string"}}, {"type": "string", "pattern": "^[a-z]{2,5}$"},
    ]  # fmt: skip
    out = []
    for k in range(n):
        props = {f"f{k}_{j}": rng.choice(kinds) for j in range(rng.randint(2, 8))}
        props[f"e{k}"] = {"enum": ["x", "y", f"z{k}"]}
        out.append({"type": "object", "properties": props, "required": list(props)})
    return out


def step_masks(make, fill, accept, seqs: list[list[int]]) -> list[float]:  # noqa: ANN001
    """Per step, the seconds to fill every live sequence's mask."""
    matchers = [make() for _ in seqs]
    per_step = []
    for step in range(max(map(len, seqs))):
        live = [
            (i, m, ids)
            for i, (m, ids) in enumerate(zip(matchers, seqs, strict=True))
            if step < len(ids)
        ]
        started = time.perf_counter()
        for i, m, _ in live:
            fill(m, i)
        per_step.append(time.perf_counter() - started)
        for _, m, ids in live:
            assert accept(m, ids[step])
    return per_step


def llguidance_side(tokenizer, vocab: int, docs, free_docs, cold_schemas) -> dict:  # noqa: ANN001
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    bitmask = allocate_token_bitmask(len(docs), vocab)
    compile_s = []
    for s in cold_schemas:
        started = time.perf_counter()
        llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)))
        compile_s.append(time.perf_counter() - started)
    out = {"compile_ms": 1e3 * statistics.median(compile_s), "compile_max_ms": 1e3 * max(compile_s)}
    for name, schema, seqs in (
        ("schema", SCHEMA, docs),
        ("any_object", {"type": "object"}, free_docs),
    ):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        steps = step_masks(
            lambda g=grammar: llguidance.LLMatcher(tok, g),
            lambda m, i: fill_next_token_bitmask(m, bitmask, i),
            lambda m, t: m.consume_token(t),
            seqs,
        )
        out[f"{name}_mask_ms"] = 1e3 * statistics.median(steps)
    return out


def xgrammar_side(tokenizer, vocab: int, docs, free_docs, cold_schemas) -> dict | None:  # noqa: ANN001
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_s = []
    for s in cold_schemas:
        started = time.perf_counter()
        compiler.compile_json_schema(json.dumps(s))
        compile_s.append(time.perf_counter() - started)
    out = {"compile_ms": 1e3 * statistics.median(compile_s), "compile_max_ms": 1e3 * max(compile_s)}
    bitmask = xgr.allocate_token_bitmask(len(docs), vocab)
    for name, compiled, seqs in (
        ("schema", compiler.compile_json_schema(json.dumps(SCHEMA)), docs),
        ("any_object", compiler.compile_builtin_json_grammar(), free_docs),
    ):
        steps = step_masks(
            lambda c=compiled: xgr.GrammarMatcher(c),
            lambda m, i: m.fill_next_token_bitmask(bitmask, i),
            lambda m, t: m.accept_token(t),
            seqs,
        )
        out[f"{name}_mask_ms"] = 1e3 * statistics.median(steps)
    return out


def main() -> None:
    from app.models.source import resolve_model
    from app.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("default"))
    vocab = len(tokenizer)
    rng = random.Random(0)
    encode = lambda d: tokenizer.encode(json.dumps(d, ensure_ascii=False), add_special_tokens=False)  # noqa: E731
    docs = [encode(d) for d in documents(rng, 32)]
    free_docs = [encode({"a": d, "b": d}) for d in documents(rng, 32)]
    cold = schemas(rng, 20)
    results = {
        "llguidance": llguidance_side(tokenizer, vocab, docs, free_docs, cold),
        "xgrammar": xgrammar_side(tokenizer, vocab, docs, free_docs, cold),
    }
    print(f"vocabulary {vocab}; 32 sequences per step; 20 cold schemas")
    for name, r in results.items():
        if r is None:
            print(f"{name:>10}: not installed")
            continue
        print(
            f"{name:>10}: compile median {r['compile_ms']:.2f} ms (max {r['compile_max_ms']:.2f}),"
            f" masks per step: schema {r['schema_mask_ms']:.2f} ms,"
            f" any object {r['any_object_mask_ms']:.2f} ms"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
