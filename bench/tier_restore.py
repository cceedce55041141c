"""Restore from the tier's bucket benchmark (on demand, not in CI): `sos restore` of one namespace
from a real server, from moto's S3 server on 127.0.0.1 and from a `file://` tier, in one run.

    python bench/tier_restore.py [--mib 256] [--latency-ms 30]

Journals MIB files of 1 MiB into a real `sos-server`, copies its objects into both tiers with
`sos_tier.Uploader` (8 MiB pieces, as a tiering server cuts them), then times `sos restore -q`
from each source (a subprocess each; its peak RSS from /usr/bin/time when there is one) and checks
the three trees are identical. Then the library restore from the `file://` tier with every GET
delayed by --latency-ms (an object store's first-byte latency) at 1, 4 and 8 GET workers: what
the parallel ranged GETs buy. moto runs in this process on 2 shared cores, so its own figures say
little about S3's throughput.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sos_client import Client  # noqa: E402 - after the checkout is on sys.path
from sos_journal import JournaledTree, JournalWriter, restore  # noqa: E402
from sos_journal.read.bucket import BucketSource  # noqa: E402
from sos_journal.rebuild.restore import rebuild_cache  # noqa: E402
from sos_tier import LocalStore, StoredKey, Uploader  # noqa: E402
from tools.moto_s3 import moto_server  # noqa: E402
from tools.server import ServerProcess  # noqa: E402


class Slow:
    """A store whose every GET first waits *delay* seconds."""

    def __init__(self, inner: LocalStore, delay: float) -> None:
        self.inner, self.delay, self.url = inner, delay, inner.url

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        time.sleep(self.delay)
        return self.inner.get(key, start, end)

    def list(self, prefix: str = "") -> Iterator[StoredKey]:
        return self.inner.list(prefix)

    def close(self) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--latency-ms", type=float, default=30.0)
    args = ap.parse_args()
    import boto3

    from sos_tier.s3 import S3Store

    base = tempfile.mkdtemp(prefix="sos-tier-restore-")
    os.environ.pop("AWS_PROFILE", None)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=f"{base}/aws-config",
        AWS_SHARED_CREDENTIALS_FILE=f"{base}/aws-credentials",
    )
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = moto_server()
    moto.start()
    srv = ServerProcess(f"{base}/data", log_path=f"{base}/server.log").start()
    try:
        host, port = moto.get_host_and_port()
        os.environ["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
        ns = "bench"
        key = srv.keygen(ns, "append")

        def fac() -> Client:
            return Client(srv.address, key, ns, timeout=60)

        w = JournalWriter(fac, ns, f"{base}/spool")
        t = JournaledTree(f"{base}/cache", w, rebuild=rebuild_cache).open()
        blob = os.urandom(1 << 20)
        for i in range(args.mib):
            t.create(f"f{i}")
            t.write(f"f{i}", 0, blob[i:] + blob[:i])
        t.close()
        objects = {}
        with fac() as c:
            for e in c.list(""):
                objects[e.name] = (c.read(e.name), bool(e.sealed))
        boto3.session.Session().client("s3").create_bucket(Bucket="bench")
        s3_url, file_url = "s3://bench/sos", f"file://{base}/tier"
        for store in (S3Store(s3_url), LocalStore(file_url)):
            up = Uploader(store)
            for name, (data, sealed) in objects.items():

                def read(b: int, e: int, d: bytes = data) -> bytes:
                    return d[b:e]

                up.sync(ns, name, read, len(data), sealed)
            store.close()
        env = dict(os.environ, SOS_SERVER=srv.address, SOS_KEY=key)
        timer = ["/usr/bin/time", "-f", "peak RSS %M KiB"] if os.path.exists("/usr/bin/time") else []
        outs: list[str] = []
        for label, extra in (("server", []), ("s3 (moto)", ["--from", s3_url]), ("file://", ["--from", file_url])):
            out = f"{base}/out-{len(outs)}"
            t0 = time.monotonic()
            r = subprocess.run(
                [*timer, sys.executable, "-m", "sos_client.cli", "restore", "-q", ns, out, *extra],
                env=env,
                capture_output=True,
                text=True,
            )
            dt = time.monotonic() - t0
            if r.returncode != 0:
                print(r.stderr, file=sys.stderr)
                return 1
            rss = r.stderr.strip().splitlines()[-1] if timer else ""
            print(f"sos restore from {label:10s} {dt:6.2f} s  {args.mib / dt:7.1f} MiB/s  {rss}", flush=True)
            outs.append(out)
        for other in outs[1:]:
            if subprocess.run(["diff", "-rq", outs[0], other]).returncode != 0:
                print(f"trees differ: {outs[0]} {other}", file=sys.stderr)
                return 1
        print("restored trees identical")
        for k in (1, 4, 8):
            src = BucketSource(Slow(LocalStore(file_url), args.latency_ms / 1000), ns, workers=k)  # type: ignore[arg-type]
            t0 = time.monotonic()
            restore(src, ns, f"{base}/slow{k}")
            dt = time.monotonic() - t0
            print(
                f"library restore, file:// + {args.latency_ms:g} ms per GET, {k} GET workers: {dt:6.2f} s", flush=True
            )
            shutil.rmtree(f"{base}/slow{k}")
    finally:
        srv.stop()
        moto.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
