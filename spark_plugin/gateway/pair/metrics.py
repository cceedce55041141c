"""The series of a gateway pair (docs/DEPLOY.md, "Gateway metrics"): which role a gateway
plays, and for a standby (``sos gateway --standby --metrics HOST:PORT``) how far its tail and
its view of the active's lease are. A standby serves the gateway's endpoint from its start
(:mod:`.metrics`: ``sos_gateway_up``, ``sos_gateway_fenced``, requests; no writer yet) plus
these, and keeps serving it once promoted, then with its writer's series too: the surviving
gateway of a pair is never without metrics.

- ``sos_gateway_role{role}``: 1 for the current one of ``standby``, ``promoting``,
  ``active`` (an active gateway, ``--standby`` or not, reports ``active``: "exactly one active
  per pair" is ``sum(sos_gateway_role{role="active"}) == 1`` over both);
- ``sos_gateway_standby_tail_record``: the last journal record the standby's cache holds
  (after a promotion: the record its writer continued after);
- ``sos_gateway_standby_last_tail_timestamp_seconds``: Unix time of its last successful look
  at the server (journal tail and lease); a standby that cannot reach the server falls
  behind silently otherwise;
- ``sos_gateway_standby_tail_rebuilds_total``: times its cache was rebuilt from the server
  (at start, and after a journal it could not continue);
- ``sos_gateway_standby_lease_seconds``: its ``--lease``;
- ``sos_gateway_standby_lease_silent_seconds``: how long the active's lease has not been
  renewed, by the standby's clock (absent before any lease was seen and once promoted): the
  standby takes over when it reaches the lease;
- ``sos_gateway_standby_promotions_total``: 1 once it was promoted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class TailView(Protocol):
    seq: int
    rebuilds: int


class LeaseView(Protocol):
    def silent_for(self) -> float | None: ...


class StandbyView(Protocol):
    """What the collector reads of a standby (``standby.Standby`` is the one): declared here
    so that the metrics do not import the standby they observe."""

    state: str
    last_tail: float
    lease: float

    @property
    def tailer(self) -> TailView: ...
    @property
    def watcher(self) -> LeaseView: ...


__all__ = ["ROLES", "RoleCollector", "StandbyCollector"]

ROLES = ("standby", "promoting", "active")


def _role_family(role: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "sos_gateway_role", "The gateway's role in its pair: 1 for the current one", labels=["role"]
    )
    for name in ROLES:
        family.add_metric([name], 1.0 if role == name else 0.0)
    return family


class RoleCollector(Collector):
    """``sos_gateway_role`` of a gateway whose role ``role()`` says (an active one: "active")."""

    def __init__(self, role: Callable[[], str]) -> None:
        self.role = role

    def collect(self) -> Iterable[Metric]:
        return [_role_family(self.role())]


class StandbyCollector(Collector):
    """The series of a standby (module docstring), read from ``standby`` at scrape time."""

    def __init__(self, standby: StandbyView) -> None:
        self.standby = standby

    def collect(self) -> Iterable[Metric]:
        s = self.standby
        out: list[Metric] = [_role_family(s.state)]
        tail = GaugeMetricFamily("sos_gateway_standby_tail_record", "The last journal record the standby's cache holds")
        tail.add_metric([], float(s.tailer.seq))
        out.append(tail)
        if s.last_tail:
            looked = GaugeMetricFamily(
                "sos_gateway_standby_last_tail_timestamp_seconds",
                "Unix time of the standby's last successful look at the server (journal tail and lease)",
            )
            looked.add_metric([], s.last_tail)
            out.append(looked)
        rebuilds = CounterMetricFamily(
            "sos_gateway_standby_tail_rebuilds", "Times the standby's cache was rebuilt from the server"
        )
        rebuilds.add_metric([], float(s.tailer.rebuilds))
        lease = GaugeMetricFamily(
            "sos_gateway_standby_lease_seconds", "The standby's --lease: silence before it takes over"
        )
        lease.add_metric([], s.lease)
        out += [rebuilds, lease]
        silent = s.watcher.silent_for()
        if silent is not None and s.state != "active":
            quiet = GaugeMetricFamily(
                "sos_gateway_standby_lease_silent_seconds",
                "Seconds the active gateway's lease has not been renewed, by the standby's clock",
            )
            quiet.add_metric([], silent)
            out.append(quiet)
        promoted = CounterMetricFamily("sos_gateway_standby_promotions", "Promotions of this standby to the active")
        promoted.add_metric([], 1.0 if s.state == "active" else 0.0)
        out.append(promoted)
        return out
