"""Prometheus metrics of one server (``GET /metrics``, text format 0.0.4).

Each app gets its own registry, so two servers in one process (tests) never share counters.
Sandboxes by status and backend are read from the database at scrape time, so they are right
even when other processes change records. ``sandlot_policy_decisions_total`` counts the
denials that reach the API (the gate's own allow/deny counts join when it reports them).

This module must not import the Manager, backends or a web framework.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable
from typing import final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The media type of :meth:`ServerMetrics.render`."""

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


@final
class ServerMetrics:
    """The counters, gauges and histograms a server keeps."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.sandboxes = Gauge(
            "sandlot_sandboxes",
            "Sandboxes not destroyed, by status and backend (read at scrape time).",
            ["status", "backend"],
            registry=self.registry,
        )
        self.exec_seconds = Histogram(
            "sandlot_exec_duration_seconds",
            "Wall time of commands run through the API, from request to exit.",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.policy_decisions = Counter(
            "sandlot_policy_decisions",
            "Policy decisions seen by the API, by outcome (allow, deny).",
            ["outcome"],
            registry=self.registry,
        )
        self.requests = Counter(
            "sandlot_http_requests",
            "HTTP requests, by method, route template and status code.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "sandlot_http_request_duration_seconds",
            "Time to the response's first byte, by route template.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.admission_waits = Counter(
            "sandlot_admission",
            "Requests over a tenant quota, by kind and outcome (admitted, rejected).",
            ["kind", "outcome"],
            registry=self.registry,
        )
        for outcome in ("allow", "deny"):
            # Present from the start, so dashboards see a zero rather than no series.
            self.policy_decisions.labels(outcome=outcome)

    def set_sandboxes(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Replace the sandbox gauge with counts of ``(status, backend)`` pairs."""
        self.sandboxes.clear()
        for (status, backend), n in Tally(pairs).items():
            self.sandboxes.labels(status=status, backend=backend).set(n)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
