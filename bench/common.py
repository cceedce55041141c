"""What several benchmark scripts share (not a benchmark): a free port, moto's S3 server with the
environment boto3 reads to reach it, a parser built from a script's docstring, the ``--server-arg``
option, and the end of a run's work directory.

The scripts import it as ``bench.common`` once the checkout is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from tools.demo_common import metrics_of

#: the checkout (tools/ is there, for the children started with ``-m tools...``)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the bucket every moto-backed benchmark writes to
BUCKET = "bench"


def scrape(srv) -> dict[str, float]:
    """The Prometheus series of a server started with ``--metrics`` (``srv.metrics_address``)."""
    return metrics_of(srv)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def doc_parser(doc: str | None, *, epilog: bool = True) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of *doc* (a script's ``__doc__``) and,
    with *epilog*, whose epilog is the rest, kept as written."""
    text = doc or ""
    if not epilog:
        return argparse.ArgumentParser(description=text.split("\n\n")[0])
    return argparse.ArgumentParser(
        description=text.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=text.split("\n\n", 1)[1],
    )


def add_server_arg(p: argparse.ArgumentParser) -> None:
    """``--server-arg`` (repeatable): extra ``sos-server serve`` arguments, in ``args.server_arg``."""
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra sos-server serve argument (repeat), e.g. --server-arg=--tier-interval=5s",
    )


def start_moto(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server as a process of its own on 127.0.0.1 (a free port), once it accepts
    connections: (process, endpoint URL)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.moto_s3", "--port", str(port)],  # S3's atomic conditional PUT
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto's server did not start")


def start_moto_env(work: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """moto's S3 server (start_moto) and the environment boto3 reads to reach it (boto3's chain:
    the endpoint, dummy keys, no profile, session token, CA bundle or shared config: the files
    named are under *work*, which has none), put into os.environ too, so that a server started
    after inherits it. (process, that environment, ``AWS_ENDPOINT_URL`` among it)"""
    cfg = os.path.join(work, "aws")
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
        os.environ.pop(var, None)
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=cfg,
        AWS_SHARED_CREDENTIALS_FILE=cfg,
        AWS_EC2_METADATA_DISABLED="true",
    )
    moto, endpoint = start_moto(env)
    env["AWS_ENDPOINT_URL"] = endpoint
    os.environ.update(env)
    return moto, env


def start_moto_bucket(work: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """start_moto_env, then the bucket ``BUCKET`` created on it."""
    import boto3

    moto, env = start_moto_env(work)
    try:
        boto3.session.Session().client("s3").create_bucket(Bucket=BUCKET)
    except BaseException:
        stop_moto(moto)
        raise
    return moto, env


def stop_moto(moto: subprocess.Popen[bytes]) -> None:
    moto.kill()
    moto.wait()


@contextlib.contextmanager
def moto_work(prefix: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A fresh work directory and moto's S3 server with the bucket ``BUCKET`` (start_moto_bucket):
    (work directory, environment); the server is killed and the directory removed at the end."""
    work = tempfile.mkdtemp(prefix=prefix)
    try:
        moto, env = start_moto_bucket(work)
        try:
            yield work, env
        finally:
            stop_moto(moto)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def remove_work(work: str, keep: bool) -> None:
    """The end of a run with ``--keep``: the work directory removed, or kept and named."""
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work}")
