"""Example streaming job for deploy/: a stateful query whose checkpoint is on the SOS mount.

The `sos mount` sidecar serves namespace SOS_NAMESPACE (default sparkjob) at SOS_MOUNT
(default /mnt/sos). `journaled_checkpoint` finds that live mount (it reads
`/mnt/sos/.sos/namespace`; it never mounts here: no server or key is given), returns the
checkpointLocation SOS_MOUNT/CHECKPOINT (default checkpoint) and registers the
MarkerListener, which marks every committed batch in the journal, so that
`sos restore NAMESPACE DIR --batch checkpoint:N` can stop exactly at batch N.
`spark_plugin/spark.py` (standard library + pyspark only) must be importable: the compose
file and the Kubernetes pod put it next to this file, at /job/spark_plugin/.

OUTPUT is the sink directory. The sink writes one directory per batch id (idempotent), so
a restart from the restored checkpoint gives exactly-once output.
"""

import os

from pyspark.sql import SparkSession, functions as F

from spark_plugin.spark import journaled_checkpoint

NAMESPACE = os.environ.get("SOS_NAMESPACE", "sparkjob")
MOUNT = os.environ.get("SOS_MOUNT", "/mnt/sos")
CHECKPOINT = os.environ.get("CHECKPOINT", "checkpoint")  # inside the namespace
OUTPUT = os.environ.get("OUTPUT", "/output")

spark = (SparkSession.builder.appName("sos-example")
         .config("spark.sql.shuffle.partitions", "2").getOrCreate())

# the sidecar's mount of NAMESPACE (a ValueError if MOUNT serves another namespace or is
# not an SOS mount); the MarkerListener is registered on `spark`
checkpoint = journaled_checkpoint(spark, NAMESPACE, mountpoint=MOUNT, checkpoint=CHECKPOINT)

counts = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 100).load()
          .withColumn("bucket", F.col("value") % 10)
          .groupBy("bucket").count())


def sink(df, batch_id):
    # overwrite by batch id: a batch re-run after a restore replaces its own output
    df.coalesce(1).write.mode("overwrite").json(os.path.join(OUTPUT, f"batch-{batch_id:09d}"))


(counts.writeStream.outputMode("update").foreachBatch(sink)
 .option("checkpointLocation", checkpoint).trigger(processingTime="10 seconds")
 .start().awaitTermination())
