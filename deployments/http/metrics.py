"""Prometheus metrics of the ingress, in a registry of its own (one per replica)."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "shoal_requests", "HTTP requests by path and status", ["path", "status"], registry=r
        )
        self.ttft = Histogram(
            "shoal_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "shoal_inter_token_latency_seconds",
            "Time between streamed tokens",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("shoal_prompt_tokens", "Prompt tokens", ["model"], registry=r)
        self.generated_tokens = Counter(
            "shoal_generation_tokens", "Generated tokens", ["model"], registry=r
        )
        labels = ["model", "replica"]
        self.running = Gauge("shoal_running_requests", "Sequences running", labels, registry=r)
        self.waiting = Gauge("shoal_waiting_requests", "Sequences waiting", labels, registry=r)
        self.kv_usage = Gauge(
            "shoal_kv_cache_usage_ratio", "KV blocks in use / total", labels, registry=r
        )
        # The second KV tier: totals since the replica started (gauges: they come with the
        # heartbeats, and a replica that restarts starts them again).
        self.tier = {
            "kv_tier_hit_tokens": Gauge(
                "shoal_kv_tier_hit_tokens",
                "Prompt tokens read back from the second KV tier instead of computed",
                labels,
                registry=r,
            ),
            "kv_tier_bytes": Gauge(
                "shoal_kv_tier_bytes", "Bytes of KV the second tier holds", labels, registry=r
            ),
            "kv_tier_read_s": Gauge(
                "shoal_kv_tier_read_seconds", "Time reading KV back from it", labels, registry=r
            ),
            "kv_tier_write_s": Gauge(
                "shoal_kv_tier_write_seconds", "Time writing KV to it", labels, registry=r
            ),
        }

        # Speculative decoding, totals since the replica started: accepted / draft is the
        # acceptance rate, 1 + accepted / proposals the tokens a verifying step yields.
        self.speculation = {
            key: Gauge(f"shoal_{key}", doc, labels, registry=r)
            for key, doc in (
                ("spec_proposals", "Sequence-steps that verified proposed tokens"),
                ("spec_draft_tokens", "Tokens proposed by speculative decoding"),
                ("spec_accepted_tokens", "Proposed tokens the model accepted"),
            )
        }

    def set_replicas(self, engines: list[dict]) -> None:
        """Every live replica's figures, from the registry's last heartbeats; replicas that
        are gone leave the gauges."""
        figures = {**self.tier, **self.speculation}
        for gauge in (self.running, self.waiting, self.kv_usage, *figures.values()):
            gauge.clear()
        for engine in engines:
            info = engine["runtime_info"]
            if not info:
                continue  # registered, no heartbeat yet
            labels = (engine["engine_name"], engine["engine_id"])
            # .get: a replica of an older version may not send every figure.
            self.running.labels(*labels).set(info.get("num_running", 0))
            self.waiting.labels(*labels).set(info.get("num_waiting", 0))
            self.kv_usage.labels(*labels).set(info.get("kv_usage", 0.0))
            for key, gauge in figures.items():
                gauge.labels(*labels).set(info.get(key, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenTimer:
    """Counts one request's tokens and feeds its TTFT and inter-token latency."""

    def __init__(self, metrics: IngressMetrics, model: str, prompt_tokens: int) -> None:
        # The model's series, looked up once: `tokens` runs for every stream message.
        self._generated = metrics.generated_tokens.labels(model)
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)
        self.started = time.perf_counter()
        self.first_at: float | None = None
        self.last: float | None = None
        metrics.prompt_tokens.labels(model).inc(prompt_tokens)

    def tokens(self, count: int) -> None:
        now = time.perf_counter()
        self._generated.inc(count)
        if self.last is None:
            self.first_at = now
            self._ttft.observe(now - self.started)
        elif count:
            self._itl.observe((now - self.last) / count)
        self.last = now
