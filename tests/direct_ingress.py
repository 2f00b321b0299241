"""Ray Serve's direct ingress for tests and benchmarks: the flags that turn it on, and
where the Ingress replica then answers.

The flags are read when Serve's controller and replicas start, so they belong in the
environment of the process that starts Ray (a `ray start`, or a driver's local Ray).
"""

import time

import httpx


def direct_ingress_flags(first_port: int) -> dict[str, str]:
    """Direct ingress on, Ingress replicas on ports from `first_port` on, and no 30 s
    wait for an external load balancer when one stops (there is none here)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first_port + 50),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def find_direct_ingress(first_port: int, skip: int, timeout_s: float = 120) -> str:
    """The Ingress replica's URL. Serve gives it the lowest free port of the range; the
    proxy's port `skip` may fall in it, and Shoal's /v1/models tells the app from other
    listeners that answer any path (Ray's metrics port)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for port in range(first_port, first_port + 50):
            if port == skip:
                continue
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                if r.status_code == 200 and r.json().get("object") == "list":
                    return f"http://127.0.0.1:{port}"
            except (httpx.HTTPError, ValueError):
                pass
        time.sleep(1)
    raise TimeoutError(f"no Ingress replica answered on ports {first_port}-{first_port + 49}")
