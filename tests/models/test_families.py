"""Every supported family against transformers in float32: greedy output token for
token over prompts longer than the sliding windows, with MoE prompts routed to every
expert."""

from pathlib import Path

import pytest
import torch

from app.models.moe import SparseMoE
from app.protocol import SamplingParams
from tests.helpers import cpu_engine, tiny_engine
from tests.models.family_checkpoints import FAMILIES, WINDOW, save_family_checkpoint

NEW_TOKENS = 12
# Phi-4-mini's LongRoPE: served within its pretraining length, the short factors apply,
# as they do in transformers for sequences that short.
ENGINE_SETTINGS = {"phi4-mini": dict(max_model_len=128)}
PROMPTS = [
    [5, 17, 99, 4, 250, 8, 8, 61, 12, 140, 33, 7, 201, 90],  # past the window
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3] * 2,
    [42, 43],
]


def transformers_greedy(directory: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    # eager: the only transformers attention that applies Gemma 2's soft-capping
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: always NEW_TOKENS
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, save_family_checkpoint(directory, request.param)


def test_greedy_output_matches_transformers(family):
    name, directory = family
    assert max(len(p) for p in PROMPTS) > WINDOW
    engine = tiny_engine(directory, **ENGINE_SETTINGS.get(name, {}))
    routed = _record_routing(engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
    assert ours == [transformers_greedy(directory, p) for p in PROMPTS], name
    if routed is not None:
        experts = engine.arch.moe.num_experts
        assert routed == set(range(experts)), f"{name}: experts {routed} of {experts} used"


def test_multimodal_gemma3_serves_its_language_model(tmp_path):
    from tests.models.family_checkpoints import save_gemma3_multimodal

    directory = save_gemma3_multimodal(tmp_path)
    engine = tiny_engine(directory)
    assert engine.arch.architecture == "Gemma3ForConditionalGeneration"
    assert set(engine.arch.eos_token_ids) == {255, 259}  # the outer config's end of turn too
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
    assert ours == [transformers_greedy(directory, p) for p in PROMPTS]


def test_longrope_beyond_the_pretraining_length_uses_the_long_factors(tmp_path):
    """Serving more context than the pretraining length: every position takes the long
    factors, as transformers does for a sequence that long (and llama.cpp for such a
    context)."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from app.models.decoder import rotary_tables
    from app.models.families import read_arch_config

    directory = save_family_checkpoint(tmp_path, "phi4-mini")
    config = AutoConfig.from_pretrained(directory)
    arch = read_arch_config(config, "phi4-mini")
    positions = torch.arange(200)  # past original_max_position_embeddings (128)
    ours, _ = rotary_tables(arch, max_positions=256)
    cos, sin = ours.tables(positions)
    ref_cos, ref_sin = Phi3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    half = cos.shape[-1]
    assert torch.allclose(cos, ref_cos[0, :, :half], atol=1e-6)
    assert torch.allclose(sin, ref_sin[0, :, :half], atol=1e-6)


def _record_routing(engine) -> set[int] | None:
    """The experts the prompts are routed to (None for a dense model)."""
    moes = [m for m in engine.loaded.model.modules() if isinstance(m, SparseMoE)]
    if not moes:
        return None
    used: set[int] = set()

    def hook(module, args, logits):
        used.update(torch.topk(logits, engine.arch.moe.top_k, dim=-1).indices.flatten().tolist())

    for moe in moes:
        moe.gate.register_forward_hook(hook)
    return used


@pytest.mark.live  # shard processes
@pytest.mark.parametrize("name", ["qwen2-moe", "phi4-mini", "gemma2"])
def test_tensor_parallel_matches_one_shard(name, tmp_path):
    """Two shards: heads, the MLPs' and every expert's intermediate dimension split; the
    shared expert, fused Phi-3 projections and Gemma's norms around sublayers included."""
    from tests.engine.test_tensor_parallel import assert_same_as, run_all, tp_engine
    from tests.helpers import tiny_config

    directory = save_family_checkpoint(tmp_path, name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    with tp_engine(tiny_config(directory, tensor_parallel_size=2, device="cpu")) as (engine, _):
        deltas = run_all(engine, params)
    assert_same_as(cpu_engine(directory), deltas, params)


def test_unsupported_features_fail_at_load_naming_them(tmp_path):
    from app.protocol import ModelLoadError

    dynamic = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    directory = save_family_checkpoint(tmp_path / "q", "qwen3", rope_parameters=dynamic)
    with pytest.raises(
        ModelLoadError, match="Qwen3ForCausalLM: unsupported RoPE scaling type 'dynamic'"
    ):
        tiny_engine(directory)
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    }
    directory = save_family_checkpoint(tmp_path / "g", "gemma3", rope_parameters=rope)
    with pytest.raises(ModelLoadError, match="Gemma3ForCausalLM: RoPE scaling on the sliding"):
        tiny_engine(directory)


@pytest.mark.parametrize("name", ["gemma2", "qwen2-moe", "phi4-mini"])
def test_bfloat16_follows_float32(name, tmp_path):
    """bfloat16 runs each family's reduced-precision paths (prepacked GEMMs with GELU on
    CPUs that have them, the C++ norm and RoPE kernels); its first greedy tokens agree
    with float32's."""
    directory = save_family_checkpoint(tmp_path, name)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    runs = {
        dtype: [
            o.outputs[0].token_ids
            for o in cpu_engine(directory, dtype=dtype).generate(PROMPTS, params)
        ]
        for dtype in ("float32", "bfloat16")
    }
    agree = sum(a == b for a, b in zip(runs["float32"], runs["bfloat16"], strict=True))
    assert agree >= len(PROMPTS) - 1, runs
