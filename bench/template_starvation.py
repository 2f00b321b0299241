"""Runaway request templates beside other clients' chats, at the Tokenizer (issue 39).

The Tokenizer deployment runs its sync methods in Serve's thread pool, as many threads
as its `max_ongoing_requests` (256, `tokenizer_max_ongoing_requests`); calls past that
wait for a thread. This drives a Tokenizer the same way, in process: N concurrent
renders of a runaway template (two nested loops of 10^5) from client a (or spread over
--clients of them), then, a second later, a plain chat (the model's own template) and a benign template of the request's
own from client b. Printed: how long b's two calls took, and what a's got.

    .venv/bin/python bench/template_starvation.py --runaways 300

It runs against the tree it sits in, so the same command in a checkout of the earlier
code measures it too (that code has no trust setting, no client and no bounds to pass).
The last line is JSON.
"""

import argparse
import collections
import inspect
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.protocol.messages import TemplateArgs  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from deployments.tokenizer import Tokenizer  # noqa: E402

RUNAWAY = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
BENIGN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ASK = [{"role": "user", "content": "What is 2+2?"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runaways", type=int, default=300)
    parser.add_argument(
        "--clients", type=int, default=1, help="clients the runaways come from (a, a1, ...)"
    )
    parser.add_argument("--threads", type=int, default=256, help="the Tokenizer's slots")
    parser.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for b")
    args = parser.parse_args()

    config = AppConfig.model_validate({"embeddings": {"enabled": False}})
    name = config.models[0].name
    new = "limits" in inspect.signature(Tokenizer.encode_chat).parameters
    if new:
        from app.protocol.messages import RenderLimits

        tokenizer = Tokenizer(config.models, True, config.template_sandbox)

        def encode(client: str, template: str | None) -> list[int]:
            own = None if template is None else TemplateArgs(template)
            limits = RenderLimits(client, 8192) if template is not None else None
            return tokenizer.encode_chat(name, ASK, None, None, "reply", own, limits)
    else:
        tokenizer = Tokenizer(config.models)

        def encode(client: str, template: str | None) -> list[int]:
            own = None if template is None else TemplateArgs(template)
            return tokenizer.encode_chat(name, ASK, None, None, "reply", own)

    pool = ThreadPoolExecutor(max_workers=args.threads)
    encode("b", BENIGN)  # the renderer started, as on a live server
    outcomes: collections.Counter[str] = collections.Counter()
    answered: list[float] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def runaway(client: str) -> None:
        try:
            encode(client, RUNAWAY)
            outcome = "rendered"
        except Exception as exc:  # noqa: BLE001
            status = getattr(exc, "status_code", "?")
            outcome = f"{status} {'ran over' if 'ran over' in str(exc) else type(exc).__name__}"
        with lock:
            outcomes[outcome] += 1
            answered.append(time.perf_counter() - started)

    for i in range(args.runaways):
        pool.submit(runaway, f"a{i % args.clients}" if args.clients > 1 else "a")
    time.sleep(1.0)

    submitted = time.perf_counter()

    def timed(template: str | None) -> float | str:  # from its submission: a thread's wait too
        try:
            encode("b", template)
        except Exception as exc:  # noqa: BLE001
            return f"{getattr(exc, 'status_code', '?')} after {time.perf_counter() - submitted:.3f}"
        return round(time.perf_counter() - submitted, 3)

    plain, benign = pool.submit(timed, None), pool.submit(timed, BENIGN)
    result: dict = {"code": "new" if new else "old", "runaways": args.runaways}
    result["clients"] = args.clients
    for label, future in (("plain_chat_s", plain), ("benign_template_s", benign)):
        left = args.wait_s - (time.perf_counter() - submitted)
        try:
            result[label] = future.result(timeout=max(0.0, left))
        except TimeoutError:
            result[label] = f"> {args.wait_s:g} (still waiting)"
    with lock:
        result["runaway_outcomes"] = dict(outcomes)
        result["runaways_answered"] = len(answered)
        result["last_runaway_answer_s"] = round(max(answered), 2) if answered else None
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    print(json.dumps(result), flush=True)
    os._exit(0)  # the earlier code's runaways would hold its threads for minutes more


if __name__ == "__main__":
    main()
