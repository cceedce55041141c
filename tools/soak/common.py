"""What every part of the crash loop shares: names, kinds of kill event, the two ways a
run ends badly, the control files' JSON."""

from __future__ import annotations

import json
import os

from tools.jvm import spark_jvm_options

#: what ``scripts/soak --help`` says the command is (the first line of the package's docstring)
DESCRIPTION = "Crash-loop harness (``scripts/soak``): the main job's Spark query under random SIGKILLs."
NAMESPACE = "soak"
#: ``disk``: the server's disk lost (a replacement server rebuilds from the tier's bucket);
#: last, so that a weight of 0 for it leaves a seed's draws of the other kinds as they were
KINDS = ("server", "mount", "driver", "all", "disk")
#: server kills are cheap (clients reconnect), driver kills cost a JVM start
DEFAULT_WEIGHTS = {"server": 0.72, "mount": 0.20, "driver": 0.04, "all": 0.04, "disk": 0.04}
#: the driver JVM restarts often: C1 only, a serial GC and the class-data archive start it
#: with less CPU (tools/jvm.py)
DRIVER_JAVA_OPTIONS = spark_jvm_options()
TRIGGER = "200 milliseconds"
#: spark.sql.shuffle.partitions of the query: one state store directory each
SHUFFLE_PARTITIONS = 2


class Violation(Exception):
    """The exactly-once / RPO-0 contract was broken: the run stops, logs are kept."""


class HarnessError(Exception):
    """The harness could not do its job (not a verdict on SOS's correctness)."""


def write_json_atomic(path: str, doc) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


CLUSTER_KINDS = ("gateway", "server", "executor", "worker", "driver", "all", "disk")
#: gateway and server kills are cheap (Hadoop's retry policy and the journal writer ride
#: through them); an executor or worker kill costs a JVM start, a driver kill the whole
#: application (driver and both executors), a total loss the cluster as well
CLUSTER_WEIGHTS = {
    "gateway": 0.32,
    "server": 0.12,
    "executor": 0.2,
    "worker": 0.14,
    "driver": 0.12,
    "all": 0.10,
    "disk": 0.05,
}
#: share of gateway kills whose replacement starts on an EMPTY cache (restored from the server)
GATEWAY_EMPTY_CACHE = 0.3
