"""Example streaming job for deploy/: a stateful query whose checkpoint SOS protects.

Two ways in, chosen by the environment:

* through `sos gateway` (SOS_GATEWAY set, e.g. https://sos-gateway:9870): what a cluster
  uses (compose's standalone cluster, Spark on Kubernetes). The key of the namespace
  SOS_NAMESPACE comes from $SOS_KEY_FILE (a file) or $SOS_KEY, never from the command line;
  `gateway_checkpoint` puts the OAuth2 and retry settings (spark.hadoop.dfs.webhdfs.*)
  into the session before it starts and the key (the OAuth2 credential, redacted in the UI
  and the event log) on its Hadoop configuration when it has started, never on a command
  line; the executors get them from the driver (the key with each task), and returns the
  webhdfs:// (swebhdfs:// for https) checkpointLocation SOS_GATEWAY/CHECKPOINT. Its
  GatewayMarkerListener marks every committed batch in the journal. The JVMs trust the
  gateway's certificate through their truststore (-Djavax.net.ssl.trustStore=...), this
  Python driver through $SSL_CERT_FILE. OUTPUT defaults to `output` on the gateway: the
  executors write the batches there, so any node can (and the journal keeps them too).
* through the `sos mount` sidecar (SOS_GATEWAY unset): one JVM. `journaled_checkpoint`
  finds the sidecar's live mount of SOS_NAMESPACE at SOS_MOUNT (it reads
  `SOS_MOUNT/.sos/namespace`; it never mounts here: no server or key is given), returns
  SOS_MOUNT/CHECKPOINT and registers the MarkerListener.

Either way `sos restore NAMESPACE DIR --batch CHECKPOINT:N` can stop exactly at batch N.
`spark_plugin/spark/`, `mounttable.py` and `gateway/client.py` (standard library + pyspark
only) must be importable: compose and the Kubernetes pods put them next to this file.

OUTPUT is the sink directory. The sink writes one directory per batch id (overwritten when
a batch runs again), so a restart from the restored checkpoint gives exactly-once output.
TRIGGER: the processing-time interval (default "10 seconds"). MAX_BATCHES (optional): stop
once that many batches have committed (tests and demos; a real job runs until stopped).
"""

import os
import time

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_plugin.spark import gateway_checkpoint, journaled_checkpoint, webhdfs_url

NAMESPACE = os.environ.get("SOS_NAMESPACE", "sparkjob")
GATEWAY = os.environ.get("SOS_GATEWAY", "")
MOUNT = os.environ.get("SOS_MOUNT", "/mnt/sos")
CHECKPOINT = os.environ.get("CHECKPOINT", "checkpoint")  # inside the namespace
TRIGGER = os.environ.get("TRIGGER", "10 seconds")
MAX_BATCHES = int(os.environ.get("MAX_BATCHES", "0"))


def namespace_key() -> str:
    path = os.environ.get("SOS_KEY_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    key = os.environ.get("SOS_KEY", "")
    if not key:
        raise SystemExit("spark_job: set SOS_KEY or SOS_KEY_FILE (a key of the namespace)")
    return key


builder = SparkSession.builder.appName("sos-example").config("spark.sql.shuffle.partitions", "2")
if GATEWAY:
    # the settings go in before the session starts: the executors get them from the driver
    checkpoint = gateway_checkpoint(builder, GATEWAY, NAMESPACE, namespace_key(), CHECKPOINT)
    OUTPUT = os.environ.get("OUTPUT") or webhdfs_url(GATEWAY, "output")
    spark = builder.getOrCreate()
    checkpoint.attach(spark)  # the batch markers (GatewayMarkerListener)
else:
    OUTPUT = os.environ.get("OUTPUT", "/output")
    spark = builder.getOrCreate()
    # the sidecar's mount of NAMESPACE (a ValueError if MOUNT serves another namespace or
    # is not an SOS mount); the MarkerListener is registered on `spark`
    checkpoint = journaled_checkpoint(spark, NAMESPACE, mountpoint=MOUNT, checkpoint=CHECKPOINT)

counts = (
    spark.readStream.format("rate-micro-batch")
    .option("rowsPerBatch", 100)
    .load()
    .withColumn("bucket", F.col("value") % 10)
    .groupBy("bucket")
    .count()
)


def sink(df, batch_id):
    # overwrite by batch id: a batch re-run after a restore replaces its own output
    df.coalesce(1).write.mode("overwrite").json(os.path.join(OUTPUT, f"batch-{batch_id:09d}"))


query = (
    counts.writeStream.outputMode("update")
    .foreachBatch(sink)
    .option("checkpointLocation", str(checkpoint))
    .trigger(processingTime=TRIGGER)
    .start()
)
if not MAX_BATCHES:
    query.awaitTermination()
else:
    # progress is reported once a batch has committed
    while query.isActive and not any(p["batchId"] >= MAX_BATCHES - 1 for p in query.recentProgress):
        query.awaitTermination(1)
    query.stop()
    listener = getattr(checkpoint, "listener", None)
    deadline = time.monotonic() + 120  # the marker listener runs asynchronously
    while listener is not None and len(listener.written) < MAX_BATCHES and time.monotonic() < deadline:
        time.sleep(0.5)
    if query.exception() is not None:
        raise SystemExit(f"spark_job: the query failed: {query.exception()}")
    print(
        f"spark_job: {MAX_BATCHES} batches committed to {checkpoint}; markers "
        f"{sorted(getattr(listener, 'written', []))}, listener errors "
        f"{getattr(listener, 'errors', [])}",
        flush=True,
    )
    spark.stop()
