"""The namespace key never reaches a Spark JVM's command line (least privilege): every local
user reads any process's ``/proc/<pid>/cmdline`` (``ps aux``), while its environment and
memory are its owner's. ``gateway_checkpoint(builder, ...)`` once put
``spark.hadoop.dfs.webhdfs.oauth2.credential=<key>`` among the Builder's configs, which
PySpark hands to spark-submit as ``--conf`` arguments of the driver JVM; the credential now
goes on the live session's Hadoop configuration only (the Builder's ``getOrCreate()``, and
``GatewayCheckpoint.attach``), which Spark ships to the tasks with each job.

- unit: a Builder given to ``gateway_checkpoint`` holds every setting but the credential,
  and its ``getOrCreate()`` puts the credential on the session's Hadoop configuration;
- real: the demo's own Spark driver (``python -m tools.demo _driver``, local mode, a real
  ``sos gateway`` and ``sos-server``) checkpoints through the gateway while no process of
  the machine (the PySpark parent, its driver JVM, any other) has the key on its command
  line; the JVM's command line does hold the other settings (what was read is the right
  thing); the query then finishes exactly once with its batch markers.
  The cluster side (executors launched by a standalone Worker): tests/spark/test_cluster.py
  (the cluster demo's run, read from /proc).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import psutil
import pytest

from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import CREDENTIAL_CONF, GATEWAY_REDACTION_REGEX, gateway_checkpoint
from tools.demo import kill_tree, make_input, start_driver
from tools.demo_common import wait_for

NS = "argvkey"
RECORDS = 300
FILES = 3
CHECKPOINT = "queries/q1"


class _Session:
    """What the helper uses of a live SparkSession: its Hadoop configuration."""

    def __init__(self) -> None:
        self.hadoop: dict[str, str] = {}
        conf = self.hadoop

        class _Conf:
            def set(self, k: str, v: str) -> None:
                conf[k] = v

        class _Jsc:
            def hadoopConfiguration(self) -> _Conf:  # py4j's name
                return _Conf()

        class _Sc:
            _jsc = _Jsc()

        self.sparkContext = _Sc()
        self._jsc = _Sc._jsc


class _Builder:
    """A SparkSession.Builder's config(), _options and getOrCreate()."""

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self.created: list[_Session] = []

    def config(self, key: str, value: str) -> _Builder:
        self._options[key] = value
        return self

    def getOrCreate(self) -> _Session:  # PySpark's name
        self.created.append(_Session())
        return self.created[-1]


def test_a_builder_gets_every_setting_but_the_credential_which_getorcreate_applies():
    key = "0123456789abcdef.secret-part"
    b = _Builder()
    loc = gateway_checkpoint(b, "http://gw.example:9870", NS, key, "chk", ride_through=False)
    assert CREDENTIAL_CONF not in b._options
    assert not [k for k, v in b._options.items() if key in v or key in k], b._options
    # every other setting is there, and the redaction for the UI and event logs
    assert {k: v for k, v in loc.conf.items() if k != CREDENTIAL_CONF}.items() <= b._options.items()
    assert b._options["spark.redaction.regex"] == GATEWAY_REDACTION_REGEX
    # what users pass to spark-submit themselves keeps the credential (for a properties file)
    assert loc.conf[CREDENTIAL_CONF] == key
    # the session the Builder makes gets it on its Hadoop configuration, without attach()
    spark = b.config("spark.app.name", "x").getOrCreate()
    assert spark.hadoop["dfs.webhdfs.oauth2.credential"] == key
    assert spark.hadoop["dfs.webhdfs.oauth2.client.id"] == NS
    # two locations on one Builder (the cluster demo's two queries): both apply
    b2 = _Builder()
    gateway_checkpoint(b2, "http://gw.example:9870", NS, key, "a", ride_through=False)
    gateway_checkpoint(b2, "http://gw2.example:9870", "other", "k2.s", "b", ride_through=False)
    assert CREDENTIAL_CONF not in b2._options
    applied = b2.getOrCreate().hadoop
    assert applied["dfs.webhdfs.oauth2.credential"] in (key, "k2.s")
    assert len(b2.created) == 1


def _cmdline(p: psutil.Process) -> str:
    """A process's command line, as ``ps`` shows it to any user ("" once it is gone)."""
    try:
        return "\0".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _ids(out_dir) -> Counter:
    ids: Counter = Counter()
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            ids.update(json.loads(line)["id"] for line in f)
    return ids


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_demo_driver_checkpoints_through_the_gateway_with_no_key_on_any_command_line(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    secret = str(key).rpartition(".")[2] or str(key)
    make_input(str(tmp_path / "input"), RECORDS, FILES)
    (tmp_path / "flags").mkdir()
    gw = GatewayProcess(NS, str(tmp_path / "cache"), sos_server.address, key, log_path=str(tmp_path / "gw.log")).start()
    driver = None
    try:
        cfg = {
            "input": str(tmp_path / "input"),
            "out": str(tmp_path / "out"),
            "flags": str(tmp_path / "flags"),
            "markers": True,
            "hang_at_batch": 1,
            "gateway": {"url": gw.url, "namespace": NS, "checkpoint": CHECKPOINT},
        }
        log = tmp_path / "driver.log"
        driver = start_driver(cfg, str(log), str(tmp_path / "driver.json"), key=key)
        hang = tmp_path / "flags" / "hang-1"
        wait_for(hang.exists, 600, "the driver in batch 1", alive=lambda: driver.poll() is None)
        # batch 0 is committed through the gateway: the key worked in the driver's JVM
        client = GatewayClient(gw.url, NS, key)
        assert client.exists(f"{CHECKPOINT}/commits/0")
        assert client.exists(f"{CHECKPOINT}/state/0/0/1.delta"), "the state store wrote through the gateway"

        ours = [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]
        jvms = [p for p in ours if "org.apache.spark.deploy.SparkSubmit" in _cmdline(p)]
        assert jvms, [_cmdline(p) for p in ours]
        jvm_cmdline = _cmdline(jvms[0])
        with open(f"/proc/{jvms[0].pid}/cmdline", "rb") as f:
            assert f.read().decode(errors="replace").rstrip("\0") == jvm_cmdline
        # what we read is the driver's real command line: the other settings are on it
        assert f"spark.hadoop.dfs.webhdfs.oauth2.client.id={NS}" in jvm_cmdline
        assert "dfs.webhdfs.oauth2.credential" not in jvm_cmdline
        for p in ours:
            assert secret not in _cmdline(p), f"the key is on {p.pid}'s command line"
        leaks = {p.pid: _cmdline(p)[:200] for p in psutil.process_iter() if secret in _cmdline(p)}
        assert not leaks, leaks

        (tmp_path / "flags" / "release-1").write_text("")
        assert driver.wait(timeout=600) == 0, log.read_text()[-6000:]
        assert client.exists(f"{CHECKPOINT}/commits/{FILES - 1}")
    finally:
        if driver is not None:
            kill_tree(driver)
        assert gw.stop() == 0, gw.log()[-4000:]
    ids = _ids(tmp_path / "out")
    assert sorted(ids) == list(range(RECORDS)) and set(ids.values()) == {1}, "exactly once"
    markers = json.loads((tmp_path / "flags" / "markers.json").read_text())
    assert markers["errors"] == [] and set(range(FILES)) <= set(markers["written"])
