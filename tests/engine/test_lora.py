"""LoRA adapters (app/models/lora.py, app/engine/adapters.py) on the real default model in
float32: random PEFT adapters, made by peft itself, each greedy token for token equal to
transformers + peft; one batch mixing four adapters and the base model equals each run
alone (the same prompt too, so the prefix cache must keep adapters' KV apart); an
unknown adapter is a 404, a bad one a 400; at most max_loras held."""

import json

import pytest
import torch

from app.engine import EngineConfig, LLMEngine
from app.models.source import default_model_path
from app.protocol.errors import InvalidRequestError, NotFoundError
from app.protocol.sampling import SamplingParams
from tests.helpers import chat_ids
from tests.lora_adapters import ATTENTION, MLP, make_adapter, write_lora_gguf

peft = pytest.importorskip("peft")

ADAPTERS = {  # name -> (seed, LoraConfig settings): ranks, targets and scalings differ
    "all8": (1, dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP)),
    "attn4": (2, dict(r=4, lora_alpha=32, target_modules=ATTENTION)),
    "mlp16rs": (3, dict(r=16, lora_alpha=8, target_modules=MLP, use_rslora=True)),
    "qv-pattern": (
        4,
        dict(
            r=8,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"down_proj": 2},
            # PEFT matches a pattern to the end of a module's whole name
            alpha_pattern={"v_proj": 24, "model.layers.3.self_attn.q_proj": 40},
        ),
    ),  # fmt: skip
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adapters(smollm2_hf, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("loras")
    paths = {}
    for name, (seed, settings) in ADAPTERS.items():
        paths[name] = root / name
        make_adapter(smollm2_hf, paths[name], seed, settings)
    return paths


@pytest.fixture(scope="module")
def engine(smollm2_engine, adapters) -> LLMEngine:
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        quantization="none",
        num_threads=2,
        kv_cache_memory_gib=0.2,
        loras={name: str(path) for name, path in adapters.items()},
    )
    return LLMEngine(config, loaded=smollm2_engine.loaded)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    asks = [
        "Write a short poem about the sea and the ships that sail on it at night.",
        "What is the capital of France? Answer in one sentence, then explain why.",
    ]
    return [chat_ids(smollm2_tokenizer, ask) for ask in asks]


def greedy(lora: str | None = None) -> SamplingParams:
    # min_tokens: EOS masked, as generate masks it with min_new_tokens
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, lora=lora)


def hf_greedy(smollm2_hf, adapter_dir, prompt: list[int]) -> list[int]:
    wrapped = peft.PeftModel.from_pretrained(smollm2_hf, str(adapter_dir))
    try:
        with torch.no_grad():
            out = wrapped.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
    finally:
        wrapped.unload()
    return out[0, len(prompt) :].tolist()


def ids(outputs) -> list[list[int]]:  # noqa: ANN001
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_each_adapter_equals_transformers_with_peft(engine, adapters, smollm2_hf, prompts):
    base = ids(engine.generate(prompts, greedy()))
    for name, path in adapters.items():
        ours = ids(engine.generate(prompts, greedy(name)))
        theirs = [hf_greedy(smollm2_hf, path, p) for p in prompts]
        assert ours == theirs, name
        assert ours != base, f"{name} changed nothing: the test would not see it missing"


def test_a_batch_of_four_adapters_and_the_base_equals_each_alone(engine, prompts):
    names = [None, *ADAPTERS]
    alone = {name: ids(engine.generate(prompts, greedy(name))) for name in names}
    # Every adapter on both prompts in one batch, each prompt the same tokens for all:
    # prefix-cache hits across adapters would show as different tokens.
    batch = [(name, p) for name in names for p in range(len(prompts))]
    mixed = ids(engine.generate([prompts[p] for _, p in batch], [greedy(n) for n, _ in batch]))
    assert mixed == [alone[name][p] for name, p in batch]


def test_unknown_and_bad_adapters_are_refused(engine, prompts, tmp_path):
    with pytest.raises(NotFoundError):
        engine.add_request("x", prompts[0], greedy("nobody"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidRequestError):
        engine.set_lora("broken", str(tmp_path))
    with pytest.raises(InvalidRequestError):
        engine.set_lora("missing", str(tmp_path / "nowhere"))
    with pytest.raises(NotFoundError):
        engine.set_lora("nobody", None)
    assert "broken" not in engine.adapters.names()


def test_an_adapter_of_another_shape_is_refused(engine, tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    tiny = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    make_adapter(tiny, tmp_path, 0, dict(r=4, lora_alpha=8, target_modules=ATTENTION))
    with pytest.raises(InvalidRequestError, match="do not fit"):
        engine.set_lora("tiny", str(tmp_path))


def test_at_most_max_loras_are_held_least_recently_used_out_and_read_again(
    smollm2_engine, adapters, prompts
):
    config = EngineConfig(
        device="cpu", dtype="float32", quantization="none", num_threads=2,
        kv_cache_memory_gib=0.05, max_loras=2,
    )  # fmt: skip
    engine = LLMEngine(config, loaded=smollm2_engine.loaded)
    a, b, c = list(adapters)[:3]
    engine.set_lora(a, str(adapters[a]))
    engine.set_lora(b, str(adapters[b]))
    first = ids(engine.generate([prompts[0]], greedy(b)))
    engine.generate([prompts[0]], greedy(a))  # a is now the most recently used
    engine.set_lora(c, str(adapters[c]))
    assert engine.adapters.names() == [a, c]
    # b's weights went for room; a request naming it reads them again (a goes now).
    assert ids(engine.generate([prompts[0]], greedy(b))) == first
    assert engine.adapters.names() == [c, b]
    engine.set_lora(b, None)  # unloaded: no request runs it again
    with pytest.raises(NotFoundError):
        engine.add_request("gone", prompts[0], greedy(b))


def test_an_adapter_never_reads_the_base_model_s_cached_prefix(smollm2_engine, adapters, prompts):
    def fresh() -> LLMEngine:
        config = EngineConfig(
            device="cpu", dtype="float32", quantization="none", num_threads=2,
            kv_cache_memory_gib=0.05, loras={"all8": str(adapters["all8"])},
        )  # fmt: skip
        return LLMEngine(config, loaded=smollm2_engine.loaded)

    cold = ids(fresh().generate(prompts, greedy("all8")))
    warm = fresh()
    base = ids(warm.generate(prompts, greedy()))
    assert ids(warm.generate(prompts, greedy("all8"))) == cold
    assert ids(warm.generate(prompts, greedy())) == base  # nor the base the adapter's
    assert warm.block_manager.prefix_hit_tokens > 0  # the cache was on, and hit


def test_a_quantized_base_keeps_its_kernels_beside_the_adapters(
    smollm2_quantized, adapters, prompts
):
    """The default GGUF as served on a CPU: its quantized layers (and, for a step of base
    rows only, its fused decode layers) with adapters beside them."""
    config = EngineConfig(
        device="cpu", dtype="float32", num_threads=2, kv_cache_memory_gib=0.05,
        loras={name: str(path) for name, path in list(adapters.items())[:2]},
    )  # fmt: skip
    engine = LLMEngine(config, loaded=smollm2_quantized.loaded)
    assert engine.loaded.model.model.fused_decode  # the base's decode steps are fused
    names = [None, *list(adapters)[:2]]
    alone = {name: ids(engine.generate(prompts, greedy(name))) for name in names}
    assert alone[names[1]] != alone[None] != alone[names[2]]
    batch = [(name, p) for name in names for p in range(len(prompts))]
    mixed = ids(engine.generate([prompts[p] for _, p in batch], [greedy(n) for n, _ in batch]))
    assert mixed == [alone[name][p] for name, p in batch]
    # After a cached prefix only a prompt's last rows run: the same logprobs to the bit
    # (the adapters' products never depend on how many rows share a step; int8
    # activations would turn an ulp into another token).
    fresh = LLMEngine(config, loaded=smollm2_quantized.loaded)
    prompt = (prompts[0] * 3)[: 2 * fresh.config.block_size + 5]  # 5 rows after the hit
    for name in names[1:]:
        sampled = greedy(name).model_copy(update={"logprobs": 1})
        cold = fresh.generate([prompt], sampled)[0].outputs[0]
        hits = fresh.block_manager.prefix_hit_tokens
        warm = fresh.generate([prompt], sampled)[0].outputs[0]
        assert fresh.block_manager.prefix_hit_tokens > hits
        assert [lp.logprob for lp in warm.logprobs] == [lp.logprob for lp in cold.logprobs]


def test_a_config_s_adapters_fit_max_loras_and_their_names_parse():
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(max_loras=1, loras={"a": "/x", "b": "/y"})
    for name in ("a:b", "latest", ""):
        with pytest.raises(ValueError, match="name"):
            EngineConfig(loras={name: "/x"})


def test_adapters_of_one_shape_batched_together_equal_each_alone(
    smollm2_engine, smollm2_hf, prompts, tmp_path
):
    """Fine-tunes of one recipe (rank and targets) are stacked and run in batched
    matmuls (app.models.lora_batch): to the bit what each computes alone."""
    settings = dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP)
    same = {f"s{i}": str(make_adapter(smollm2_hf, tmp_path / f"s{i}", 10 + i, settings))
            for i in range(4)}  # fmt: skip
    config = EngineConfig(
        device="cpu", dtype="float32", quantization="none", num_threads=2,
        kv_cache_memory_gib=0.1, loras=same,
    )  # fmt: skip
    engine = LLMEngine(config, loaded=smollm2_engine.loaded)
    names = [None, *same]
    alone = {name: ids(engine.generate(prompts, greedy(name))) for name in names}
    batch = [(name, p) for name in names for p in range(len(prompts))]
    steps = []
    stack = engine.runner.inputs._adapters._stack
    engine.runner.inputs._adapters._stack = lambda *a: steps.append(stack(*a)) or steps[-1]
    mixed = ids(engine.generate([prompts[p] for _, p in batch], [greedy(n) for n, _ in batch]))
    assert any(s is not None and len(s.uids) == 4 for s in steps)  # it did stack them
    assert mixed == [alone[name][p] for name, p in batch]
    # Adapters' rows only, as many each: the blocks are views of the step's rows.
    batch = [(name, p) for p in range(len(prompts)) for name in same]
    mixed = ids(engine.generate([prompts[p] for _, p in batch], [greedy(n) for n, _ in batch]))
    assert mixed == [alone[name][p] for name, p in batch]


def test_a_llama_cpp_lora_gguf_runs_as_its_peft_directory(engine, adapters, prompts, tmp_path):
    """The file llama.cpp's convert_lora_to_gguf.py makes of a PEFT adapter (written here
    as it writes it: its q and k in llama.cpp's rotary order) runs to the same logprobs,
    bit for bit. llama.cpp keeps one alpha: the adapter with one rank and alpha."""
    attn = engine.loaded.model.model.layers[0].self_attn
    gguf_file = write_lora_gguf(
        adapters["all8"], tmp_path / "all8.gguf", attn.num_heads, attn.num_kv_heads
    )
    engine.set_lora("all8-gguf", str(gguf_file))
    sampled = [greedy(name).model_copy(update={"logprobs": 1}) for name in ("all8", "all8-gguf")]
    peft_out, gguf_out = (engine.generate([prompts[0]], s)[0].outputs[0] for s in sampled)
    assert [lp.logprob for lp in gguf_out.logprobs] == [lp.logprob for lp in peft_out.logprobs]
    engine.set_lora("all8-gguf", None)
    with pytest.raises(InvalidRequestError, match="not a LoRA adapter GGUF"):
        engine.set_lora("base", str(default_model_path()))  # the base model's own GGUF
    (tmp_path / "junk.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(InvalidRequestError, match="not a GGUF file"):
        engine.set_lora("junk", str(tmp_path / "junk.gguf"))
