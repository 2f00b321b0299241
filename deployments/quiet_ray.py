"""Quieter timers for the Ray that `serve run app:graph` starts on this machine.

Serve's defaults tick for big clusters: the controller runs its control loop every
0.1 s, and every replica and handle flushes its cached metrics every 0.1 s, whether or
not anything happened. On a laptop with one small model that is most of what the app
spends at idle. `serve run` calls the application builder before it starts Ray, and
every process of a Ray it starts (the controller, the proxy, the replicas) inherits the
driver's environment; so the builder sets these before Ray starts. A variable already
set wins, and a Ray that is already running (`ray start`, KubeRay) keeps its own: set
them there in its environment (docs/operating.md).

What the slower timers cost: a deployment change (a replica started, a dead one
replaced, an autoscaling decision) is acted on up to 0.5 s later rather than 0.1 s,
Serve's own request metrics reach Ray's exporter (which reports every 10 s) in
steps of 1 s, and a new worker's log lines reach the `serve run` console up to 5 s
after it starts.
"""

import os

QUIET_DEFAULTS = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # Ray's log monitor lists the log directory every 0.5 s for new workers' files.
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
}


def quiet_ray_defaults() -> dict[str, str]:
    """Set the defaults not already set, unless this process is connected to Ray
    already (then its Ray and its controller were started without them); returns what
    it set."""
    import ray

    if ray.is_initialized():
        return {}
    chosen = {name: value for name, value in QUIET_DEFAULTS.items() if name not in os.environ}
    os.environ.update(chosen)
    return chosen
