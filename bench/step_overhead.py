"""Host time per decode step: the engine with its model's forward replaced by a stub.

On a GPU the model's forward is launched and the host goes on; what is left on the host
(scheduling, building the step's inputs, sampling's launches and bookkeeping, the
deltas) sets the pace once the forward is fast, whatever the machine. This measures it
anywhere: a tiny random Llama whose `forward` returns rows of a fixed logits tensor
(`--vocab` columns, small by default so that no arithmetic hides the host's work), at
each number of running sequences, after every prompt is prefilled, over `--steps` decode
steps of sequences that never finish.

Each step's time is split into schedule (Scheduler.schedule), prepare (the runner's
inputs and attention metadata: ModelRunner.prepare and run, but the stub), sample
(Sampler.sample_each) and post (appending tokens, deltas, stats: the rest of
LLMEngine.step). `--peer` times the same steps in the engine as it was at a git commit
(a worktree of it), side by side in the same run. The last line printed is a JSON
object with `ms_per_step_<n>` for each n and the split.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(  # a small Llama: its layers never run, only its config and cache matter
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
PHASES = ("schedule", "prepare", "sample", "post")


class PhaseClock:
    """Wraps an engine's phase methods and sums the time spent in each. A phase entered
    inside another counts once, in the outer one: the runner's `run` and `prepare` are
    one phase, and in older engines `run` calls `prepare`."""

    def __init__(self, engine) -> None:  # noqa: ANN001 (LLMEngine, of whichever commit)
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._inside = False
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "prepare", "prepare")
        self._wrap(engine.runner, "run", "prepare")
        self._wrap(engine.sampler, "sample_each", "sample")

    def _wrap(self, owner, name: str, phase: str) -> None:  # noqa: ANN001
        inner = getattr(owner, name)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self._inside:
                return inner(*args, **kwargs)
            self._inside = True
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start
                self._inside = False

        setattr(owner, name, timed)


def stub_forward(engine, vocab: int, rows: int) -> None:  # noqa: ANN001
    """The model returns logits without computing: a fixed (rows, vocab) table, so a
    greedy sequence's next token is the same every step (its row's argmax). Peaked as a
    language model's are (normal, standard deviation 4: at 49,152 tokens the best 1,024
    hold about 97% of the mass), which top-p's cost depends on."""
    import torch

    table = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4

    def forward(input_ids, positions, metadata, logits_rows, images=None, lora=None):  # noqa: ANN001, ANN202
        return table[: logits_rows.shape[0]]

    engine.runner.model.forward = forward


def measure(num_seqs: int, args: argparse.Namespace, model_dir: Path) -> dict:
    """Milliseconds per decode step with `num_seqs` running sequences, and its split."""
    import torch

    from app.engine import EngineConfig, LLMEngine

    try:
        from app.models.attention_backends import select_backend
    except ImportError:  # a --peer commit from before attention_backends.py
        from app.models.attention import select_backend
    from app.models.loader import random_model
    from app.models.source import ModelSource
    from app.protocol import SamplingParams

    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=max(num_seqs, 1),
        max_num_batched_tokens=max(2048, num_seqs * args.prompt),
        kv_cache_memory_gib=0.5,
        structured_outputs=False,
        num_threads=1,
    )
    backend = select_backend(config.attention_backend, config.torch_device, config.block_size)
    source = ModelSource(name="stub", directory=model_dir)
    loaded = random_model(source, backend, config.torch_dtype, config.torch_device)
    engine = LLMEngine(config, loaded=loaded)
    stub_forward(engine, args.vocab, max(num_seqs, 1) * args.prompt)
    params = SamplingParams(
        max_tokens=args.steps + 16, ignore_eos=True, temperature=args.temperature, top_p=args.top_p
    )
    g = torch.Generator().manual_seed(1)
    for i in range(num_seqs):
        prompt = torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()  # the prefills
    for _ in range(8):
        engine.step()  # warm
    clock = PhaseClock(engine)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    assert len(engine.scheduler.running) == num_seqs, "every sequence runs the whole time"
    total = sum(times)
    split = {p: clock.totals[p] * 1000 / args.steps for p in PHASES[:3]}
    split["post"] = total * 1000 / args.steps - sum(split.values())
    figures = {"ms_per_step": statistics.median(times) * 1000, "mean_ms": total * 1000 / args.steps}
    return figures | {f"{p}_ms": round(v, 4) for p, v in split.items()}


def write_model(root: Path, vocab: int) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab, **SHAPE).save_pretrained(root)
    return root


def run_here(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp), args.vocab)
        return {n: measure(n, args, model_dir) for n in args.seqs}


def run_peer(commit: str, args: argparse.Namespace) -> dict:
    """The same measurement on the engine at `commit`, in a worktree, in a child process
    (this file's own code drives it: the engine's phase names are stable)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "peer"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), commit],
            check=True,
        )
        try:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child-root", str(tree)]
            cmd += forwarded(args)
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])


def forwarded(args: argparse.Namespace) -> list[str]:
    return [
        f"--seqs={','.join(map(str, args.seqs))}",
        f"--steps={args.steps}",
        f"--prompt={args.prompt}",
        f"--vocab={args.vocab}",
        f"--temperature={args.temperature}",
        f"--top-p={args.top_p}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1,64,256", help="running sequences, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--peer", help="a git commit whose engine runs the same steps")
    parser.add_argument("--child-root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seqs = [int(n) for n in args.seqs.split(",")]
    sys.path.insert(0, args.child_root or str(ROOT))
    if args.child_root:
        print(json.dumps(run_here(args)))
        return
    peer = run_peer(args.peer, args) if args.peer else None
    ours = run_here(args)
    sampling = "greedy" if args.temperature == 0 else f"T={args.temperature} top_p={args.top_p}"
    print(f"decode steps, forward stubbed, vocab {args.vocab}, {sampling}, {args.steps} steps")
    result: dict = {}
    for n in args.seqs:
        r = ours[n]
        split = ", ".join(f"{p} {r[f'{p}_ms']:.3f}" for p in PHASES)
        line = f"{n:4d} sequences: {r['ms_per_step']:.3f} ms a step ({split})"
        if peer:
            line += f"; {args.peer}: {peer[n]['ms_per_step']:.3f} ms"
            line += f" ({peer[n]['ms_per_step'] / r['ms_per_step']:.2f}x)"
            result[f"peer_ms_per_step_{n}"] = round(peer[n]["ms_per_step"], 4)
        print(line)
        result[f"ms_per_step_{n}"] = round(r["ms_per_step"], 4)
        result |= {f"{p}_ms_{n}": r[f"{p}_ms"] for p in PHASES}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
