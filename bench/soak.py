"""Soak: mixed load over every dialect for a long while, a model replica killed at intervals.

Starts the app the way users do (`serve run` of app:graph with its defaults, from a Serve
config that only sets the host 127.0.0.1 and a free port) on a Ray of its own, and joins
that Ray as a driver by its GCS address. Then:

- warm-up: every scenario once, then `--warmup-s` of the mixed load;
- the idle figures of the model replica (contexts, KV blocks in use: its engine's stats)
  and each process's RSS, by role: ingress, tokenizer, model replica and its engine
  process, operator, embedder, registry, Serve's controller and proxy, GCS, raylet;
- `--minutes` of `--clients` closed-loop users, each walking a shuffled cycle of every
  dialect (bench/soak_load.py): OpenAI chat (streamed and not), completions, structured
  outputs (json_schema), embeddings, Responses (stored ones deleted), Anthropic
  Messages, Ollama chat and generate, llama.cpp /completion, Parrot contexts (fill,
  fork, generate, free), Assistants runs (thread, streamed run, thread deleted), and
  streams the client closes after three chunks; `--max-tokens` output tokens each;
- every `--kill-every-s`, ray.kill of the ModelServer replica actor (found by its Serve
  actor name); Serve must replace it. A kill's window runs from 1 s before it to 2 s after
  Serve reports the replacement running; a request is outside the kills when it neither
  started nor was in flight within any window (counted from its scenario's first call
  when it relies on state that call made on the replica: a Parrot context, say);
- when the load is over and the replica idle: its figures and the RSS again.

Reported: calls by dialect and status, the 5xx (and 2xx streams that ended with an error
event, and calls that got no answer) outside the kills (target 0), each role's RSS at
start and end (target < 5 % growth after the warm-up), contexts and KV blocks in use at
the end less those at idle at the start (target 0), and what `serve run` exited with on
SIGTERM. It stops what it started: SIGTERM to `serve run`, then bench/ray_processes.py's
stop for any leftover. The last line printed is a JSON object.

    .venv/bin/python bench/soak.py --minutes 30 --kill-every-s 300    # about 35 minutes
    .venv/bin/python bench/soak.py --minutes 3 --kill-every-s 90      # the CI version
"""

import argparse
import asyncio
import collections
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.soak_cluster import App  # noqa: E402
from bench.soak_load import DIALECTS, MODEL, Call, Soak, every_dialect_once, setup, users  # noqa: E402

RSS_TARGET_PCT = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def killer(app: App, start: float, args: argparse.Namespace, kills: list[dict]) -> None:
    """A replica killed every `kill_every_s` while the load runs; each kill's window."""
    end = start + 60 * args.minutes
    k = 1
    while start + k * args.kill_every_s < end:
        await asyncio.sleep(max(0.0, start + k * args.kill_every_s - time.monotonic()))
        at = time.monotonic()
        victim = await asyncio.to_thread(app.kill_replica)
        try:
            took = await asyncio.to_thread(app.wait_replaced, victim, args.replace_timeout_s)
        except TimeoutError:
            took = None  # the window stays open to the end
        kills.append({"at_s": round(at - start, 1), "victim": victim, "replaced_after_s": took})
        print(f"kill {k} at {at - start:.0f} s: {victim}; replaced after {took} s", flush=True)
        k += 1


def windows(kills: list[dict], start: float) -> list[tuple[float, float]]:
    return [
        (
            start + k["at_s"] - 1.0,
            float("inf")
            if k["replaced_after_s"] is None
            else start + k["at_s"] + k["replaced_after_s"] + 2.0,
        )
        for k in kills
    ]


def outside(call: Call, spans: list[tuple[float, float]]) -> bool:
    """Neither started nor in flight within a window; a call that relies on state its
    scenario made earlier (a Parrot context, a thread's, a stored response's) counts
    from the scenario's first call (a kill in between takes the state with it)."""
    began = call.sent if call.since is None else call.since
    return all(call.ended < lo or began > hi for lo, hi in spans)


def failure(status: str) -> str | None:
    """What kind of failure a call's status is, if any (a 4xx: none of the soak's
    requests is wrong, so one says the bench or the app broke)."""
    if status.startswith("5"):
        return "5xx"
    if status.startswith("4"):
        return "4xx"
    if "stream-error" in status:
        return "stream_error"
    if not status[:1].isdigit():
        return "no_answer"
    return None


def tally(calls: list[Call], spans: list[tuple[float, float]]) -> dict:
    by_dialect: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    in_windows: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()
    sample = []
    for call in calls:
        by_dialect[call.dialect][call.status] += 1
        if not outside(call, spans):
            in_windows[call.status] += 1
            continue
        kind = failure(call.status)
        if kind:
            failures[kind] += 1
            if len(sample) < 10:
                sample.append(f"{call.dialect} {call.status} {call.detail}")
    answered = {d for d, c in by_dialect.items() if any(s.startswith("2") for s in c)}
    return {
        "requests": len(calls),
        "by_dialect": {d: dict(sorted(c.items())) for d, c in sorted(by_dialect.items())},
        "in_kill_windows": dict(sorted(in_windows.items())),
        "server_errors_outside_kills": failures["5xx"],
        "client_errors_outside_kills": failures["4xx"],
        "stream_errors_outside_kills": failures["stream_error"],
        "unanswered_outside_kills": failures["no_answer"],
        "failures_outside_kills_sample": sample,
        "dialects_without_2xx": [d for d in DIALECTS if d not in answered],
    }


def write_calls(path: Path, calls: list[Call], spans: list, start: float) -> None:
    """Every call of the soak, a JSON line each (times in s from its start)."""
    with path.open("w") as out:
        for c in calls:
            row = {"dialect": c.dialect, "sent_s": round(c.sent - start, 3)}
            row |= {"ended_s": round(c.ended - start, 3), "status": c.status}
            row |= {"in_kill_window": not outside(c, spans), "detail": c.detail}
            out.write(json.dumps(row) + "\n")


def idle_figures(app: App, timeout_s: float = 120) -> dict:
    """The replica's figures once nothing runs or waits there (and 3 s more)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = app.replica_stats()
        if stats["num_running"] == stats["num_waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    time.sleep(3)
    stats = app.replica_stats()
    keys = ("num_running", "num_waiting", "num_contexts", "kv_blocks_used", "kv_blocks_free")
    return {k: stats[k] for k in (*keys, "kv_blocks_total", "replica")}


def rss_report(start: dict, end: dict) -> dict:
    rows = {}
    for role in sorted(set(start) | set(end)):
        a, b = start.get(role), end.get(role)
        row = {
            "start_mib": round(a["rss_mib"], 1) if a else None,
            "end_mib": round(b["rss_mib"], 1) if b else None,
            "same_pids": bool(a and b and sorted(a["pids"]) == sorted(b["pids"])),
        }
        if a and b:
            row["growth_pct"] = round(100 * (b["rss_mib"] / a["rss_mib"] - 1), 2)
        rows[role] = row
    return rows


async def soak_phase(app: App, soak: Soak, args: argparse.Namespace) -> tuple[float, list]:
    start = time.monotonic()
    kills: list[dict] = []
    await asyncio.gather(
        users(soak, args.clients, start + 60 * args.minutes), killer(app, start, args, kills)
    )
    return start, kills


def run(app: App, args: argparse.Namespace) -> dict:
    print(f"healthy after {app.wait_healthy(args.start_timeout_s):.0f} s", flush=True)
    app.connect()
    warm = Soak(app.url, args.max_tokens)
    asyncio.run(setup(warm))
    asyncio.run(every_dialect_once(warm))
    asyncio.run(users(warm, args.clients, time.monotonic() + args.warmup_s))
    print(f"warm-up: {len(warm.calls)} calls", flush=True)
    idle_start, rss_start = idle_figures(app), app.rss()
    soak = Soak(app.url, args.max_tokens, assistant=warm.assistant)
    start, kills = asyncio.run(soak_phase(app, soak, args))
    idle_end, rss_end = idle_figures(app), app.rss()
    result = {"minutes": args.minutes, "kill_every_s": args.kill_every_s}
    result |= {"clients": args.clients, "max_tokens": args.max_tokens, "kills": kills}
    result["warmup"] = tally(warm.calls, [])["by_dialect"]
    spans = windows(kills, start)
    result |= tally(soak.calls, spans)
    if args.calls_out:
        write_calls(Path(args.calls_out), soak.calls, spans, start)
    rss = rss_report(rss_start, rss_end)
    growth = {r: v["growth_pct"] for r, v in rss.items() if "growth_pct" in v}
    targeted = {r: g for r, g in growth.items() if not r.startswith("other")}
    result["rss"] = rss
    result["rss_growth_max_pct"] = max(targeted.values(), default=None)
    result["rss_growth_worst_role"] = max(targeted, key=targeted.get, default=None)
    result["idle_start"], result["idle_end"] = idle_start, idle_end
    result["contexts_leaked"] = idle_end["num_contexts"] - idle_start["num_contexts"]
    result["kv_blocks_leaked"] = idle_end["kv_blocks_used"] - idle_start["kv_blocks_used"]
    result["requests_left_running"] = idle_end["num_running"] + idle_end["num_waiting"]
    return result


def report(result: dict) -> None:
    print(f"\n{'dialect':24s} calls by status")
    for dialect, counts in result["by_dialect"].items():
        print(f"{dialect:24s} {counts}")
    print(f"in kill windows: {result['in_kill_windows']}")
    print(f"\n{'role':40s} {'start MiB':>9} {'end MiB':>8} {'growth':>7}")
    for role, row in result["rss"].items():
        g = row.get("growth_pct")
        print(
            f"{role[:40]:40s} {row['start_mib'] or 0:>9.1f} {row['end_mib'] or 0:>8.1f} "
            f"{'' if g is None else f'{g:+.1f}%':>7}{'' if row['same_pids'] else '  (new pids)'}"
        )
    targets = {
        "no 5xx outside kills": result["server_errors_outside_kills"] == 0,
        "no 4xx outside kills": result["client_errors_outside_kills"] == 0,
        "no stream errors outside kills": result["stream_errors_outside_kills"] == 0,
        f"RSS growth < {RSS_TARGET_PCT:.0f} %": (result["rss_growth_max_pct"] or 0)
        < RSS_TARGET_PCT,
        "no contexts leaked": result["contexts_leaked"] == 0,
        "no KV blocks leaked": result["kv_blocks_leaked"] == 0,
        "every dialect answered 2xx": not result["dialects_without_2xx"],
    }
    for name, met in targets.items():
        print(f"target {name}: {'met' if met else 'NOT met'}")
    result["targets_met"] = targets
    for line in result["failures_outside_kills_sample"]:
        print(f"  outside kills: {line}")


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every-s", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    parser.add_argument("--replace-timeout-s", type=float, default=300.0)
    parser.add_argument("--calls-out", help="write every call here, a JSON line each")
    args = parser.parse_args()

    app = App(Path(__file__).resolve().parents[1], args.port or free_port(), MODEL)
    print(f"serve run of app:graph at {app.url} (log: {app.log})", flush=True)
    try:
        result = run(app, args)
    finally:
        app.stop()
    result["serve_run_exit_code_on_sigterm"] = app.exit_code
    report(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
