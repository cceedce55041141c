"""Crash-loop harness (``scripts/soak``): the main job's Spark query under random SIGKILLs.

It kills the server, the mount or the gateway, the driver, executors, the server's disk, or
all at once, restarts them, and checks after each that the committed batches hold exactly
the input (RPO 0). By role: :mod:`.common` (names, the two error kinds), :mod:`.driver` (the
driver process), :mod:`.checks` (the exactly-once / RPO-0 verdict), :mod:`.harness` (the crash
loop on one machine: what it kills and how it recovers), :mod:`.cluster_mode` and
:mod:`.pair_mode` (the same on a standalone cluster through ``sos gateway``, one or a pair),
:mod:`.report` (what is printed at the end) and :mod:`.cli` (the command, its exit codes).
May import: the product packages (sos_*, spark_plugin) and the other tools; nothing imports it
but the tests and ``python -m tools.soak``.
"""

from tools.soak.checks import GatewayView, checkpoint_commits, source_offset, state_files
from tools.soak.cli import main
from tools.soak.cluster_mode import ClusterSoak
from tools.soak.common import (
    CLUSTER_KINDS,
    KINDS,
    NAMESPACE,
    HarnessError,
    Violation,
    read_json,
    write_json_atomic,
)
from tools.soak.driver import driver_main
from tools.soak.harness import Soak

__all__ = [
    "CLUSTER_KINDS",
    "KINDS",
    "NAMESPACE",
    "ClusterSoak",
    "GatewayView",
    "HarnessError",
    "Soak",
    "Violation",
    "checkpoint_commits",
    "driver_main",
    "main",
    "read_json",
    "source_offset",
    "state_files",
    "write_json_atomic",
]
