"""Prometheus metrics of one adapter, in their own registry so several apps can live in one process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass
class AdapterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "rollbus_adapter_requests",
            "Requests answered, by route template and status",
            ["route", "status"],
            registry=r,
        )
        self.turns = Counter(
            "rollbus_adapter_turns",
            "Turns generated, by chain kind and stop reason",
            ["chain_kind", "stop_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "rollbus_adapter_prompt_tokens", "Prompt tokens sent to the engine", registry=r
        )
        self.reused_tokens = Counter(
            "rollbus_adapter_reused_tokens",
            "Prompt tokens taken verbatim from earlier turns of the chain",
            registry=r,
        )
        self.output_tokens = Counter(
            "rollbus_adapter_output_tokens", "Tokens sampled by the engine", registry=r
        )
        self.new_chains = Counter(
            "rollbus_adapter_new_chains", "Chains started, by reason", ["reason"], registry=r
        )
        self.unattributed = Counter(
            "rollbus_adapter_unattributed_requests",
            "Requests routed to a chain that never trains, by cause (tool_peer: sent by a tool; "
            "no_agent_call, contested_call, restored_main)",
            ["cause"],
            registry=r,
        )
        self.ambiguous = Counter(
            "rollbus_adapter_ambiguous_attributions",
            "Conversations whose origin could not be proven, by cause (contested_call: two claim one "
            "Agent call, neither trains; restored_main: a rewrite of a main chain rebuilt from the bus)",
            ["cause"],
            registry=r,
        )
        self.routes_missing = Counter(
            "rollbus_adapter_routes_missing",
            "MoE turns recorded without routed experts (the engine sent none, or rows that do not fit)",
            registry=r,
        )
        self.stream_retries = Counter(
            "rollbus_adapter_stream_retries",
            "Retries of a cut Responses stream answered with the rest of the recorded turn (no new sample)",
            registry=r,
        )
        self.in_flight = Gauge("rollbus_adapter_in_flight", "Turns being generated", registry=r)
        self.backlog = Gauge("rollbus_adapter_bus_backlog", "Records waiting for the bus", registry=r)
        self.turn_seconds = Histogram(
            "rollbus_adapter_turn_seconds",
            "From request to published turn",
            registry=r,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
        )
        self.engine_seconds = Histogram(
            "rollbus_adapter_engine_seconds",
            "Time waiting for the engine",
            registry=r,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
        )

    def count_route(self, agent: Any) -> None:
        """A request routed to ``agent`` (``rollbus.services.adapter.sessions.Agent``): counted if it never
        trains."""
        if agent.kind == "unattributed":
            self.unattributed.labels(agent.cause or "unknown").inc()


class CountRequests:
    """ASGI middleware: count every HTTP answer by route path and status."""

    def __init__(self, app: ASGIApp, metrics: AdapterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", "unmatched")  # the template: bounded labels
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
