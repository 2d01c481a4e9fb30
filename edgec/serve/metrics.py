"""Prometheus metrics of one server (a registry of its own: no process-global state)."""

from __future__ import annotations

from edgec.serve.memory import ServerMemory
from edgec.serve.scheduler import Scheduler, Ticket

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


class Metrics:
    def __init__(self, scheduler: Scheduler, memory: ServerMemory) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_resident_memory_bytes and friends
        Gauge("edgec_queue_depth", "Requests waiting for a session", registry=registry).set_function(
            lambda: scheduler.queued
        )
        Gauge("edgec_active_sessions", "Sessions holding a cache state", registry=registry).set_function(
            lambda: scheduler.active
        )
        Gauge("edgec_kv_bytes_in_use", "Bytes of the running sessions' cache states", registry=registry).set_function(
            lambda: scheduler.in_use
        )
        budget = Gauge("edgec_kv_bytes_budget", "Bytes the sessions' cache states may take", registry=registry)
        budget.set(memory.session_budget if memory.session_budget is not None else float("inf"))
        Gauge("edgec_model_resident_bytes", "Resident bytes after loading and warm-up", registry=registry).set(
            memory.model_bytes
        )
        self.ttft = Histogram(
            "edgec_time_to_first_token_seconds",
            "From arrival (queue included) to the first token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.rate = Histogram(
            "edgec_decode_tokens_per_second",
            "Decode speed of each finished session",
            buckets=RATE_BUCKETS,
            registry=registry,
        )
        self.sessions = Counter(
            "edgec_sessions",
            "Sessions admitted, by cache capacity (full = the bundle's)",
            ["capacity"],
            registry=registry,
        )
        self.requests = Counter(
            "edgec_requests", "Requests by outcome (completed, cancelled, rejected)", ["outcome"], registry=registry
        )
        self.tokens = Counter("edgec_generated_tokens", "Tokens generated", registry=registry)

    def admitted(self, ticket: Ticket) -> None:
        self.sessions.labels("full" if ticket.capacity is None else str(ticket.capacity)).inc()

    def finished(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def ended(self, session, arrived: float) -> None:
        if session.first_token_at is not None:
            self.ttft.observe(session.first_token_at - arrived)
        if session.stats.decode_tokens_per_second > 0:
            self.rate.observe(session.stats.decode_tokens_per_second)
        self.tokens.inc(session.stats.new_tokens)
        self.finished(session.outcome)

    @property
    def content_type(self) -> str:
        from prometheus_client import CONTENT_TYPE_LATEST

        return CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
