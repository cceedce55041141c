"""Example streaming job for deploy/: a stateful query whose checkpoint is on the SOS mount.

CHECKPOINT (default /mnt/sos/checkpoint) must be a path on `sos mount`; OUTPUT is the
sink directory. The sink writes one file per batch id (idempotent), so a restart from the
restored checkpoint gives exactly-once output.
"""

import os

from pyspark.sql import SparkSession, functions as F

CHECKPOINT = os.environ.get("CHECKPOINT", "/mnt/sos/checkpoint")
OUTPUT = os.environ.get("OUTPUT", "/output")

spark = (SparkSession.builder.appName("sos-example")
         .config("spark.sql.shuffle.partitions", "2").getOrCreate())

counts = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 100).load()
          .withColumn("bucket", F.col("value") % 10)
          .groupBy("bucket").count())


def sink(df, batch_id):
    # overwrite by batch id: a batch re-run after a restore replaces its own output
    df.coalesce(1).write.mode("overwrite").json(os.path.join(OUTPUT, f"batch-{batch_id:09d}"))


(counts.writeStream.outputMode("update").foreachBatch(sink)
 .option("checkpointLocation", CHECKPOINT).trigger(processingTime="10 seconds")
 .start().awaitTermination())
