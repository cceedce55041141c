"""The namespace key never reaches a Spark JVM's command line (least privilege): every local
user reads any process's ``/proc/<pid>/cmdline`` (``ps aux``), while its environment and
memory are its owner's. ``gateway_checkpoint(builder, ...)`` once put
``spark.hadoop.dfs.webhdfs.oauth2.credential=<key>`` among the Builder's configs, which
PySpark hands to spark-submit as ``--conf`` arguments of the driver JVM; the credential now
goes on the live session's Hadoop configuration only (the Builder's ``getOrCreate()``, and
``GatewayCheckpoint.attach``), which Spark ships to the tasks with each job.

- unit: a Builder given to ``gateway_checkpoint`` holds every setting but the credential,
  and its ``getOrCreate()`` puts the credential on the session's Hadoop configuration;
- real, local mode: tests/gateway/test_total_loss.py reads the command lines of its first
  driver (the cluster demo's driver in local mode, a real ``sos gateway`` and ``sos-server``)
  while it is parked mid-batch after checkpointing through the gateway: no process of the
  machine has the key on its command line, the JVM's holds the other settings; its
  successor finishes exactly once with its batch markers;
- real, a standalone cluster (executors launched by a Worker): tests/spark/test_cluster.py
  (the cluster demo's run, read from /proc).
"""

from __future__ import annotations

from spark_plugin.spark import CREDENTIAL_CONF, GATEWAY_REDACTION_REGEX, gateway_checkpoint

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
