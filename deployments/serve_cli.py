"""SIGTERM in the `serve run app:graph` process drains the app, then exits 0 as on Ctrl-C.

`docker stop` and systemd stop a service with SIGTERM. In the `serve run` process Ray's
core worker installs a fatal-signal handler for SIGTERM (with `ray.init`, over anything
installed before it): the process printed a stack dump and died (code 15), its streams
cut. Ctrl-C raises KeyboardInterrupt in the main thread instead, on which `serve run`
calls `serve.shutdown()` and exits 0; but that shutdown takes the proxies down with the
replicas, which cuts open streams too (tested). So SIGTERM, handled from right after
`ray.init` (Ray's post-init hook), first deletes every Serve application, which stops
each replica gracefully: it takes no new requests and gives its open streams its
`graceful_shutdown_timeout_s` while the proxies still carry them. Then it interrupts the
main thread as Ctrl-C does. The drain runs on a thread of its own: the signal may land
while the main thread is inside a Ray call.

Only in the `serve run` CLI process, which imports `app:graph` itself before it starts
Ray: not in a Ray worker or replica (Ray's own handler ends those), not where the graph
is built in a Serve controller's task (KubeRay, a config file), not in tests or a
program of one's own that calls `graph`. A second SIGTERM while draining ends the
process at once.
"""

import logging
import signal
import sys
import threading
import time
from types import FrameType

logger = logging.getLogger("ray.serve")


def drain_on_sigterm() -> bool:
    """In the `serve run` CLI process before it starts Ray: have SIGTERM raise
    KeyboardInterrupt in the main thread once Ray is started. Whether it did."""
    import ray
    import ray._private.worker as ray_worker

    if (
        "ray.serve.scripts" not in sys.modules  # the `serve` CLI's module
        or ray.is_initialized()
        or threading.current_thread() is not threading.main_thread()
    ):
        return False
    if _install not in ray_worker._post_init_hooks:
        ray_worker._post_init_hooks.append(_install)
    return True


# However the deletes go, the process ends: past the default replica drain (30 s) with
# room for the engine to stop, a stuck delete no longer keeps `docker stop` waiting.
DRAIN_LIMIT_S = 90.0


def _install() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one: stop now
    threading.Thread(target=_drain_then_interrupt, name="shoal-sigterm", daemon=True).start()


def _drain_then_interrupt() -> None:
    from ray import serve

    try:
        names = list(serve.status().applications)
        logger.info("SIGTERM: draining %s, then shutting down", ", ".join(names) or "nothing")
        for name in names:
            serve.delete(name, _blocking=False)  # all at once: each drains on its own clock
        deadline = time.monotonic() + DRAIN_LIMIT_S
        while serve.status().applications and time.monotonic() < deadline:
            time.sleep(0.5)
    except Exception:
        logger.exception("SIGTERM: draining failed; shutting down")
    # As Ctrl-C: KeyboardInterrupt in the main thread, even in the middle of a sleep.
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
