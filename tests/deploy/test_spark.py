"""Issue 11, item 4: the Spark side of the Kubernetes example, run for real where it can be.

A real Spark query (`local[2]`: no cluster here) runs deploy/spark_job.py with
deploy/k8s/spark-gateway.conf (only its spark.kubernetes.* settings dropped, its paths
mapped here, client mode), the job's environment from the conf's driverEnv, only the files
the ConfigMap `spark-job` holds, against a `sos gateway` started with the Deployment's TLS
arguments over swebhdfs:// with the documented certificates and truststore (openssl and
keytool lines of docs/DEPLOY.md). So the truststore options, the OAuth2 settings, the
key file, SSL_CERT_FILE for the marker listener and the ConfigMap's file list are what a
cluster would use. The batches commit, the sink's output lands on the gateway too, the
markers are written, and `sos restore --batch` stops at a batch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import sos_command
from tests.deploy.support import K8S, ROOT, k8s_documents, one, option, run_documented, spark_conf
from tools.demo import DRIVER_JVM_OPTIONS, committed_batches

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1500)]

BATCHES = 3
K8S_GATEWAY = spark_conf()["spark.kubernetes.driverEnv.SOS_GATEWAY"]  # the conf's URL, mapped here


def _configmap_files(job_dir):
    """The ConfigMap spark-job as the driver's pod template mounts it (nothing else)."""
    (driver,) = k8s_documents("spark-pod-driver.yaml")
    mount = next(m for m in driver["spec"]["containers"][0]["volumeMounts"] if m["name"] == "job")
    vol = next(v for v in driver["spec"]["volumes"] if v["name"] == "job")
    for item in vol["configMap"]["items"]:
        src = ROOT / ("deploy" if item["path"] == "spark_job.py" else "") / item["path"]
        dst = job_dir / item["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return mount["mountPath"]


def test_spark_job_checkpoints_over_swebhdfs_with_the_kubernetes_conf(tmp_path, sos_server_factory):
    for cn in ("/CN=sos-server", "/CN=sos-gateway"):
        run_documented(tmp_path, "openssl req", cn)
    run_documented(tmp_path, "keytool -importcert")
    tls = tmp_path / "deploy" / "tls"

    conf = spark_conf()
    namespace = conf["spark.kubernetes.driverEnv.SOS_NAMESPACE"]
    srv = sos_server_factory(args=["--tls-cert", tls / "tls.crt", "--tls-key", tls / "tls.key"], start=False)
    writer_key = srv.keygen(namespace, "append")
    job_key = srv.keygen(namespace, "append")
    srv.start()
    server = f"localhost:{srv.host_port[1]}"

    # the gateway with the Deployment's TLS arguments (files of its Secrets, here)
    dep = one(k8s_documents("sos-gateway.yaml"), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[2] == namespace
    local = {
        option(args, "--tls-ca"): tls / "tls.crt",
        option(args, "--tls-cert"): tls / "gateway.crt",
        option(args, "--tls-key"): tls / "gateway.key",
    }
    extra = [x for opt in ("--tls-ca", "--tls-cert", "--tls-key") for x in (opt, str(local[option(args, opt)]))]
    gw = GatewayProcess(
        namespace, str(tmp_path / "cache"), server, writer_key, extra_args=extra, log_path=str(tmp_path / "gateway.log")
    ).start()
    try:
        assert gw.url.startswith("https://")
        # the properties file: the conf without its Kubernetes part, paths mapped here
        trust_dir = conf["spark.kubernetes.driver.secrets.sos-gateway-trust"]
        key_dir = conf["spark.kubernetes.driver.secrets.sparkjob-key"]
        (tmp_path / "trust").mkdir()
        shutil.copyfile(tls / "truststore.p12", tmp_path / "trust" / "truststore.p12")
        shutil.copyfile(tls / "gateway.crt", tmp_path / "trust" / "ca.crt")
        (tmp_path / "keys").mkdir()
        (tmp_path / "keys" / "key").write_text(job_key + "\n")

        def here(value: str) -> str:
            return (
                value.replace(trust_dir, str(tmp_path / "trust"))
                .replace(key_dir, str(tmp_path / "keys"))
                .replace(K8S_GATEWAY, gw.url)
            )

        props = {
            k: here(v)
            for k, v in conf.items()
            if not k.startswith("spark.kubernetes.") and k != "spark.submit.deployMode"
        }
        props["spark.driver.extraJavaOptions"] += " " + DRIVER_JVM_OPTIONS
        props["spark.driver.memory"] = "768m"
        props["spark.ui.enabled"] = "false"
        props_file = tmp_path / "spark.conf"
        props_file.write_text("".join(f"{k} {v}\n" for k, v in props.items()))

        job_dir = tmp_path / "job"
        mount_path = _configmap_files(job_dir)
        app = re.search(r"local://(\S+)", (K8S / "spark-gateway.conf").read_text()).group(1)
        assert app.startswith(mount_path + "/")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SOS_", "PYSPARK", "SPARK_"))}
        env.pop("PYTHONPATH", None)  # the job finds spark_plugin next to itself, as in the pod
        prefix = "spark.kubernetes.driverEnv."
        env |= {k[len(prefix) :]: here(v) for k, v in conf.items() if k.startswith(prefix)}
        env |= {
            "SOS_KEY_FILE": str(tmp_path / "keys" / "key"),
            "MAX_BATCHES": str(BATCHES),
            "TRIGGER": "1 second",
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
        }
        assert env["SOS_GATEWAY"] == gw.url and env["SSL_CERT_FILE"].endswith("/trust/ca.crt")
        spark_submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
        log = tmp_path / "driver.log"
        with open(log, "wb") as logf:
            proc = subprocess.run(
                [
                    spark_submit,
                    "--master",
                    "local[2]",
                    "--deploy-mode",
                    "client",
                    "--properties-file",
                    str(props_file),
                    str(job_dir / os.path.relpath(app, mount_path)),
                ],
                cwd=tmp_path,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                timeout=1200,
                check=False,
            )
        text = log.read_text(errors="replace")
        assert proc.returncode == 0, text[-8000:]
        assert job_key not in text  # the credential is redacted
        m = re.search(
            r"spark_job: (\d+) batches committed to (\S+); markers \[([\d, ]*)\], "
            r"listener errors \[\]",
            text,
        )
        assert m, text[-8000:]
        assert m.group(2) == gw.url.replace("https://", "swebhdfs://") + "/checkpoint"
        markers = {int(x) for x in m.group(3).split(",") if x.strip()}
        assert set(range(BATCHES - 1)) <= markers  # the last one may still be on its way
    finally:
        assert gw.stop() == 0, gw.log()[-4000:]

    env = dict(os.environ, SOS_KEY=writer_key)
    tls_args = ["--server", server, "--tls-ca", str(tls / "tls.crt")]
    subprocess.run(
        [*sos_command(), "restore", "-q", *tls_args, namespace, str(tmp_path / "restored")],
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    restored = tmp_path / "restored"
    done = committed_batches(str(restored / "checkpoint"))
    assert set(range(BATCHES)) <= done
    for b in range(BATCHES):  # the executors' output went through the gateway too
        out = restored / "output" / f"batch-{b:09d}"
        assert (out / "_SUCCESS").exists(), sorted(os.listdir(restored / "output"))
        assert any(p.name.startswith("part-") for p in out.iterdir())
    # the markers: a restore stops right after batch 1's commit
    subprocess.run(
        [*sos_command(), "restore", "-q", *tls_args, namespace, str(tmp_path / "at1"), "--batch", "checkpoint:1"],
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    assert committed_batches(str(tmp_path / "at1" / "checkpoint")) == {0, 1}
