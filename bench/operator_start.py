"""Adding a second model to a running app: the operator API versus a full redeploy.

A tiny chat model (random weights, the default model's tokenizer), served from a local
fixture hub as bench/tiny-chat, is "first" in the app. While a long stream on "first" runs
(max_tokens 2000, ignore_eos), a model "second" is added, alternately (--repeat times each):
- (A) operator: /api/inference/start?alias=second (the repo downloaded once beforehand);
- (B) redeploy: serve.run of the whole app with "second" in its config, the only way before
  the operator API ("second" gets the engine settings the operator gives an alias).
Per run: time-to-serve (start call or serve.run -> the first 200 from a chat with "second"),
the first stream's fate (open until the bench closed it, finished, error, cut), its chunks
during the start and after, its inter-chunk gaps (p50, p99, max, count over --gap-ms) in the
2 s before the start and from the start to "second" served, and whether the "first" replica
(its engine id in /bench/engines) was replaced. Then the medians, the ratio B/A of
time-to-serve, and a JSON line with every figure.

Run: .venv/bin/python bench/operator_start.py [--port 8011] [--repeat 2]
It starts its own Ray (8 CPUs) and Serve (HTTP on 127.0.0.1:--port) and stops both at the end.
"""

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO, APP, PREFIX = "bench/tiny-chat", "bench", "/bench"
HELLO = [{"role": "user", "content": "hello"}]


class Stream(threading.Thread):
    """A long streamed chat on "first": each SSE chunk's arrival time, and how it ended."""

    def __init__(self, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.times: list[float] = []
        self.outcome, self.ended = "open", 0.0
        self.closing = threading.Event()

    def run(self) -> None:
        body = {"model": "first", "messages": HELLO, "max_tokens": self.max_tokens}
        body |= {"stream": True, "ignore_eos": True, "temperature": 0}
        finish = None
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(600, connect=10)) as http,
                http.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r,
            ):
                if r.status_code != 200:
                    self.outcome = f"HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    if self.closing.is_set():
                        self.outcome = "open"  # closed by the bench: never interrupted
                        return
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    self.times.append(time.perf_counter())
                    data = json.loads(line[6:])
                    if "error" in data:
                        self.outcome = f"error: {str(data['error'])[:60]}"
                        return
                    finish = (data.get("choices") or [{}])[0].get("finish_reason") or finish
            self.outcome = f"finished ({finish})" if finish else "cut (no finish_reason)"
        except Exception as e:
            self.outcome = f"cut ({type(e).__name__})"
        finally:
            self.ended = time.perf_counter()

    def close(self) -> None:
        self.closing.set()
        self.join(timeout=60)
        if self.is_alive():
            self.outcome = "stalled"  # no chunk for 60 s after the close


def gap_stats(times: list[float], lo: float, hi: float, over_ms: float) -> dict[str, float]:
    """Inter-chunk gaps (ms) that overlap [lo, hi]."""
    gaps = [1000 * (b - a) for a, b in zip(times, times[1:], strict=False) if b > lo and a < hi]
    if not gaps:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "over": 0}
    p99 = statistics.quantiles(gaps, n=100)[98] if len(gaps) > 1 else gaps[0]
    over = sum(g > over_ms for g in gaps)
    return {"p50": statistics.median(gaps), "p99": p99, "max": max(gaps), "over": over}


def engines(base: str, name: str) -> set[str]:
    listed = httpx.get(f"{base}/engines", timeout=30).json()["engines"]
    return {e["engine_id"] for e in listed if e["engine_name"] == name}


def wait_served(base: str, timeout_s: float) -> float:
    """Until a chat with model "second" answers 200: the time it did."""
    body = {"model": "second", "messages": HELLO, "max_tokens": 4, "temperature": 0}
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        try:
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
            if r.status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass  # a redeployed ingress may refuse connections for a moment
        time.sleep(0.2)
    raise TimeoutError(f'"second" not served after {timeout_s:.0f} s')


def one_run(base: str, args: argparse.Namespace, variant: str, start: Any) -> dict[str, Any]:
    """A long stream on "first"; `start()` after --lead-s; "second" served; the stream closed."""
    ids = engines(base, "first")
    stream = Stream(base, args.max_tokens)
    stream.start()
    deadline = time.perf_counter() + 120
    while not stream.times and stream.is_alive():
        if time.perf_counter() > deadline:
            raise TimeoutError("the stream on first sent nothing")
        time.sleep(0.01)
    time.sleep(args.lead_s)
    t0 = time.perf_counter()
    started = start()  # the redeploy's thread, or None
    served = wait_served(base, args.timeout)
    time.sleep(args.after_s)
    stream.close()  # before the join: a stopping ingress would wait for it
    if started is not None:
        started.join(timeout=args.timeout)
    times = stream.times
    return {
        "variant": variant,
        "serve_s": served - t0,
        "outcome": stream.outcome,
        "ended_before_served": 0 < stream.ended < served,
        "chunks_during": sum(t0 < t <= served for t in times),
        "chunks_after": sum(t > served for t in times),
        "before": gap_stats(times, t0 - args.lead_s, t0, args.gap_ms),
        "during": gap_stats(times, t0, served, args.gap_ms),
        "replica": "same" if engines(base, "first") == ids else "new",
    }


def row_line(i: int, r: dict[str, Any]) -> str:
    b, d = r["before"], r["during"]
    return (
        f"{i:3d} {r['variant']:10s} {r['serve_s']:8.2f} {r['outcome'][:24]:24s} "
        f"{r['chunks_during']:6d}/{r['chunks_after']:<5d} "
        f"{b['p50']:6.1f} {b['p99']:7.1f} {b['max']:7.1f} {b['over']:3d} | "
        f"{d['p50']:6.1f} {d['p99']:7.1f} {d['max']:7.1f} {d['over']:3d}  {r['replica']}"
    )


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=2000, help="the long stream's")
    parser.add_argument("--lead-s", type=float, default=2.0, help="stream time before the start")
    parser.add_argument("--after-s", type=float, default=1.0, help="stream time after served")
    parser.add_argument("--gap-ms", type=float, default=200.0, help="a gap longer is counted")
    parser.add_argument("--timeout", type=float, default=600.0, help="per start, seconds")
    args = parser.parse_args()

    import ray
    from ray import serve

    from bench.serve_overhead import wait_healthy
    from deployments.builder import build_app
    from deployments.config import AppConfig
    from tests.fixture_hub import fixture_hub, save_tiny_chat_model

    base = f"http://127.0.0.1:{args.port}{PREFIX}"
    tmp = tempfile.TemporaryDirectory(prefix="shoal-bench-")
    state = Path(tmp.name)
    tiny = save_tiny_chat_model(state / "tiny")
    engine = {"model": str(tiny)}
    first = {"name": "first", "num_cpus": 0.5, "engine": engine | {"kv_cache_memory_gib": 0.1}}
    # What the operator builds for an alias: the engine's defaults, operator.model_num_cpus.
    second = {"name": "second", "num_cpus": 0.5, "engine": engine}
    rows: list[dict[str, Any]] = []
    with fixture_hub() as hub:
        hub.add_directory(REPO, tiny)

        def config(models: list[dict]) -> AppConfig:
            return AppConfig.model_validate(
                {
                    "models": models,
                    "embeddings": {"enabled": False},
                    "assistants": {"database_path": str(state / "assistants.sqlite3")},
                    "operator": {
                        "hub_endpoint": hub.url,
                        "private_hosts": ["127.0.0.1"],
                        "models_dir": str(state / "models"),
                        "model_num_cpus": 0.5,
                    },
                }
            )

        one, two = config([first]), config([first, second])

        def deploy(cfg: AppConfig) -> None:  # returns once the app is RUNNING
            serve.run(build_app(cfg), name=APP, route_prefix=PREFIX)

        def api(path: str, **params: str) -> Any:
            r = httpx.get(f"{base}/api/{path}", params=params, timeout=300)
            r.raise_for_status()
            return r.json()

        def start_a() -> None:
            api("inference/start", alias="second", modelRepo=REPO)

        def start_b() -> threading.Thread:
            thread = threading.Thread(target=deploy, args=(two,), daemon=True)
            thread.start()
            return thread

        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": args.port})
            deploy(one)
            wait_healthy(f"{base}/health")
            api("downloads/enqueue", modelRepo=REPO)
            deadline = time.time() + 120
            while api("downloads", modelRepo=REPO)["DownloadItems"][0]["status"] != "complete":
                if time.time() > deadline:
                    raise TimeoutError(f"{REPO}: the download did not complete")
                time.sleep(0.3)
            body = {"model": "first", "messages": HELLO, "max_tokens": 4}
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).raise_for_status()
            print(
                f"{'run':>3} {'variant':10s} {'serve_s':>8} {'first stream':24s} "
                f"{'during/after':>12} gaps ms before: p50, p99, max, >thr | during: the same"
                "  replica"
            )
            for _ in range(args.repeat):
                rows.append(one_run(base, args, "A operator", start_a))
                print(row_line(len(rows), rows[-1]))
                api("inference/reset", alias="second")
                rows.append(one_run(base, args, "B redeploy", start_b))
                print(row_line(len(rows), rows[-1]))
                deploy(one)  # back to the one-model app
                wait_healthy(f"{base}/health")
        finally:
            serve.shutdown()
            ray.shutdown()
            tmp.cleanup()

    med: dict[str, dict[str, float]] = {}
    for v in ("A", "B"):
        runs = [r for r in rows if r["variant"].startswith(v)]
        med[v] = {
            "serve_s": statistics.median(r["serve_s"] for r in runs),
            "before_p99_ms": statistics.median(r["before"]["p99"] for r in runs),
            "during_p99_ms": statistics.median(r["during"]["p99"] for r in runs),
            "during_max_ms": statistics.median(r["during"]["max"] for r in runs),
            "interrupted": sum(not r["outcome"].startswith(("open", "fin")) for r in runs),
            "replica_replaced": sum(r["replica"] == "new" for r in runs),
        }
        m = med[v]
        print(
            f"median {v}: serve {m['serve_s']:.2f} s; first stream gap p99 "
            f"{m['before_p99_ms']:.1f} ms before -> {m['during_p99_ms']:.1f} ms during "
            f"(max {m['during_max_ms']:.1f} ms); streams interrupted {m['interrupted']}/"
            f"{len(runs)}; first replica replaced {m['replica_replaced']}/{len(runs)}"
        )
    ratios = {"B/A serve_s": med["B"]["serve_s"] / med["A"]["serve_s"]}
    for v, m in med.items():
        ratios[f"{v} gap p99 during/before"] = m["during_p99_ms"] / max(m["before_p99_ms"], 1e-9)
    for k, x in ratios.items():
        print(f"{k} = {x:.2f}")
    print(json.dumps({"runs": rows, "medians": med, "ratios": ratios}, default=str))


if __name__ == "__main__":
    main()
