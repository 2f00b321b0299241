"""Serve capacity: how many tokens a second one Ingress replica delivers, with no model.

The app is the shipped one (`build_app`, the FastAPI Ingress with every route, the
Tokenizer, Serve's proxy, the ModelServer deployment's code), except that the model
replica's engine is a StubEngine (bench/stub_engine.py): every open request gets one
token per step at a set rate, in the model's real tokenizer, so the ingress detokenizes
and frames real text. What it measures is Serve's path alone, on any machine. The
replica paces its streams as a GPU replica would (no message budget, a stream's tokens
merged up to 70 ms: StreamPacer), unless told otherwise.

A load generator in its own process (raw asyncio sockets and httptools, no HTTP client
library: it shares the CPUs; bench/sse_load.py) keeps `--clients` SSE streams open on
the OpenAI chat-completions endpoint, each request `--max-tokens` long and sent again as
soon as it ends. The bench steps the per-stream rate up; at each step, after a warm-up,
it measures over a window:
- the aggregate rate delivered (tokens/s as the clients receive them: the text's
  characters at the stub's tokens per character, every request streaming the same text);
- the gaps between consecutive SSE messages that carry text, within a request, as a
  client sees them (p50, p99);
- the CPU each process spent (psutil cpu_times deltas; pids from Ray's actor table):
  Serve's proxy, the Ingress replica, the ModelServer replica, the Tokenizer, the rest
  of Ray (raylet, GCS, controller, other replicas: `ray_other`) and the load generator
  itself, as microseconds per delivered token and per message.
It stops at the first step whose p99 gap is 100 ms or more (or that delivers under 90%
of what it offers, or has errors) and reports the highest rate delivered under that gap,
and the highest at any gap. The last line is a JSON object: `tok_s_one_ingress` and
`cpu_us_per_token` (a dict by process, with their sum as `total`, read at the best step,
or at the first when none held the gap). `--quick` is a CI-sized run (16 clients, a few
seconds a step); `--direct-ingress` serves HTTP from the Ingress replica itself.
"""

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sse_load import run_load  # noqa: E402

from tests.direct_ingress import direct_ingress_flags, find_direct_ingress  # noqa: E402

APP = "bench"
MAX_GAP_S = 0.1  # a stream whose p99 gap passes this no longer reads as streaming
TARGET_TOK_S = 10_000  # what one GPU replica can produce


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def start_serve(config, port: int, direct: bool) -> str:  # noqa: ANN001
    """The app on a new local Ray; its URL (the proxy's, or the Ingress replica's own
    port with `direct`)."""
    import ray
    import stub_engine
    from ray import cloudpickle, serve

    from deployments.builder import build_app

    cloudpickle.register_pickle_by_value(stub_engine)  # replicas need not find bench/
    first_port = port + 1000
    flags = direct_ingress_flags(first_port) if direct else {}
    os.environ.update(flags)  # read by Serve's controller and replicas as Ray starts them
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise SystemExit(f"port {port} is busy")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(config, model_server=stub_engine.StubModelServerDeployment)
    serve.run(app, name=APP, route_prefix="/", blocking=False)
    wait_healthy(f"http://127.0.0.1:{port}/health")
    return find_direct_ingress(first_port, skip=port) if direct else f"http://127.0.0.1:{port}"


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


def serve_pids() -> dict[str, list[int]]:
    """The processes to account, by role: Serve's proxy and the app's replicas (pids from
    Ray's actor table, read from the GCS: the state API's list_actors needs the dashboard,
    which this Ray runs without), and `ray_other`: every other process under this driver
    (raylet, GCS, Serve's controller, the registry and operator replicas)."""
    import psutil
    from ray._private import state

    names = {
        "ProxyActor": "proxy",
        f"ServeReplica:{APP}:Ingress": "ingress",
        f"ServeReplica:{APP}:Tokenizer": "tokenizer",
    }
    pids: dict[str, list[int]] = {}
    for actor in state.actors().values():
        if actor["State"] != "ALIVE":
            continue
        cls = actor["ActorClassName"]
        role = names.get(cls) or ("model" if cls.startswith(f"ServeReplica:{APP}:Model") else None)
        if role is not None:
            pids.setdefault(role, []).append(actor["Pid"])
    named = {pid for group in pids.values() for pid in group}
    others = psutil.Process().children(recursive=True)
    pids["ray_other"] = [p.pid for p in others if p.pid not in named]
    return pids


def tokens_per_char(model, max_tokens: int) -> float:  # noqa: ANN001
    """Of the stub's output: every request streams the same text."""
    from stub_engine import output_text

    from app.models.source import resolve_model
    from app.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(model.engine.model))
    return max_tokens / len(output_text(tokenizer, max_tokens))


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """User and system CPU seconds so far, by role (a process gone since counts 0)."""
    import psutil

    out = {}
    for role, group in pids.items():
        out[role] = 0.0
        for pid in group:
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            out[role] += t.user + t.system
    return out


def idle_cores(pids: dict[str, list[int]], seconds: float = 5.0) -> dict[str, float]:
    """What the app's processes spend with no traffic (Serve's control loops, metrics)."""
    before = cpu_seconds(pids)
    time.sleep(seconds)
    after = cpu_seconds(pids)
    return {k: round((after[k] - before[k]) / seconds, 3) for k in pids}


def measure_step(
    rate: float,
    clients: int,
    args,
    pids: dict[str, int],
    control,
    set_rate,  # noqa: ANN001
) -> dict:
    """One step: warm up at `rate` tokens/s per stream, then measure a window."""
    set_rate(rate)
    time.sleep(args.warmup_s)
    before = cpu_seconds(pids)
    control.send("start")
    time.sleep(args.window_s)
    control.send("stop")
    seen = control.recv()
    after = cpu_seconds(pids)
    tokens = seen["tokens"]
    cpu = {k: after[k] - before[k] for k in pids}
    us = {k: round(1e6 * v / tokens, 1) if tokens else None for k, v in cpu.items()}
    if tokens:
        us["total"] = round(sum(v for v in us.values() if v is not None), 1)
    per_message = {k: round(1e6 * v / max(seen["messages"], 1)) for k, v in cpu.items()}
    p50, p99 = seen["gap_p50_s"], seen["gap_p99_s"]
    return {
        "rate_per_stream": rate,
        "offered_tok_s": round(rate * clients, 1),
        "tok_s": round(tokens / seen["seconds"], 1),
        "gap_p50_ms": None if p50 is None else round(1000 * p50, 1),
        "gap_p99_ms": None if p99 is None else round(1000 * p99, 1),
        "messages_per_s": round(seen["messages"] / seen["seconds"], 1),
        "tokens_per_message": round(tokens / max(seen["messages"], 1), 2),
        "requests": seen["requests"],
        "errors": seen["errors"],
        "cpu_us_per_token": us,
        "cpu_us_per_message": per_message,
        "cpu_cores": {k: round(v / seen["seconds"], 2) for k, v in cpu.items()},
        "load": load(),
    }


def passed(step: dict) -> bool:
    p99 = step["gap_p99_ms"]
    return (
        p99 is not None
        and p99 < 1000 * MAX_GAP_S
        and step["errors"] == 0
        and step["tok_s"] >= 0.9 * step["offered_tok_s"]
    )


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--rates", default="40,60,80,120,160", help="tokens/s per stream, in steps")
    parser.add_argument("--warmup-s", type=float, default=6.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=8013)
    parser.add_argument("--quick", action="store_true", help="16 clients, short steps (CI)")
    parser.add_argument("--direct-ingress", action="store_true", help="no proxy hop")
    # A GPU replica's pacing (its engine does not share the CPU): no budget, a stream's
    # tokens merged up to 70 ms (StreamPacer); the path's own jitter adds ~30 ms at p99.
    parser.add_argument("--stream-messages-per-s", type=float, default=0.0)
    parser.add_argument("--stream-message-interval-s", type=float, default=0.07)
    args = parser.parse_args()
    if args.quick:
        args.clients, args.max_tokens, args.rates = 16, 120, "40,80"
        args.warmup_s, args.window_s = 2.0, 3.0
    rates = [float(r) for r in args.rates.split(",")]

    from ray import serve

    from deployments.config import AppConfig
    from deployments.model_deployment import model_deployment_name

    # Room for every client at the model: this measures Serve's path, not admission.
    model = {
        "max_ongoing_requests": max(64, args.clients),
        "stream_messages_per_s": args.stream_messages_per_s,
        "stream_message_interval_s": args.stream_message_interval_s,
    }
    config = AppConfig.model_validate({"embeddings": {"enabled": False}, "models": [model]})
    m = config.models[0]
    print(
        f"{args.clients} clients, {args.max_tokens} tokens a request; replica pacing "
        f"{m.stream_messages_per_s:g} messages/s, {m.stream_message_interval_s:g} s apart; "
        f"{'direct ingress' if args.direct_ingress else 'through the proxy'}; {load()}"
    )
    steps: list[dict] = []
    ctx = mp.get_context("spawn")
    control, child_end = ctx.Pipe()
    try:
        url = start_serve(config, args.port, args.direct_ingress)
        handle = serve.get_deployment_handle(model_deployment_name(m.name), app_name=APP)
        pids = serve_pids()
        idle = idle_cores(pids)
        print(f"idle cores by process: {idle}")
        body = {
            "model": m.name,
            "messages": [{"role": "user", "content": "Tell me about the tides."}],
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        loader = ctx.Process(
            target=run_load,
            args=(url, body, args.clients, tokens_per_char(m, args.max_tokens), child_end),
        )
        loader.start()
        pids["loadgen"] = [loader.pid]
        print(f"pids {pids}")
        for rate in rates:
            step = measure_step(
                rate,
                args.clients,
                args,
                pids,
                control,
                lambda r: handle.set_rate.remote(r).result(),
            )
            steps.append(step)
            print(json.dumps(step))
            if not passed(step):
                break
        control.send("quit")
        loader.join(30)
    finally:
        if "loader" in locals() and loader.is_alive():
            loader.kill()
        serve.shutdown()
        import ray

        ray.shutdown()
    report(steps, idle, config, args)


def report(steps: list[dict], idle: dict, config, args) -> None:  # noqa: ANN001
    good = [s for s in steps if passed(s)]
    best = max(good, key=lambda s: s["tok_s"]) if good else None
    # The cost is read at the best step (or the first, if none passed).
    costed = best or steps[0]
    us = costed["cpu_us_per_token"]
    result = {
        "tok_s_one_ingress": best["tok_s"] if best else 0.0,
        "tok_s_max": max(s["tok_s"] for s in steps),  # at any gap
        "gap_p99_ms": costed["gap_p99_ms"],
        "cpu_us_per_token": us,  # by process; `total` is their sum (load generator included)
        "idle_cores": idle,  # with no traffic, by process
        "clients": args.clients,
        "stream_messages_per_s": config.models[0].stream_messages_per_s,
        "stream_message_interval_s": config.models[0].stream_message_interval_s,
        "max_tokens": args.max_tokens,
        "direct_ingress": args.direct_ingress,
        "steps": steps,
    }
    print()
    for s in steps:
        mark = "ok " if passed(s) else "OUT"
        print(
            f"{mark} offered {s['offered_tok_s']:>8.0f}  delivered {s['tok_s']:>8.1f} tok/s  "
            f"gap p50 {s['gap_p50_ms']} p99 {s['gap_p99_ms']} ms  {s['messages_per_s']} msg/s  "
            f"{s['tokens_per_message']} tok/msg  us/token {s['cpu_us_per_token']}  ({s['load']})"
        )
    print(
        f"highest rate with p99 gap < {1000 * MAX_GAP_S:.0f} ms: {result['tok_s_one_ingress']} "
        f"tok/s (at any gap: {result['tok_s_max']})"
    )
    serving = [us.get(k) or 0.0 for k in ("ingress", "proxy")]
    cores = TARGET_TOK_S * sum(serving) / 1e6
    if us.get("ingress"):
        replicas = math.ceil(TARGET_TOK_S * us["ingress"] / 1e6)
        result["ingress_replicas_for_10k"] = replicas
        print(
            f"a {TARGET_TOK_S} tok/s replica, at {us['ingress']} us/token in the ingress and "
            f"{us.get('proxy') or 0.0} in the proxy: {cores:.2f} cores of ingress and proxy, "
            f"{replicas} ingress replica(s) at one core each"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
