"""Disaster recovery from Python: ``sos restore --batch`` run with this interpreter, to rebuild
a checkpoint as it was when a batch committed (from the server, or from its bucket alone)."""

from __future__ import annotations

import os
import subprocess
import sys


def sos_command() -> list[str]:
    """argv prefix that runs the ``sos`` command with this interpreter."""
    return [sys.executable, "-c", "import sys; from sos_client.cli import main; sys.exit(main())"]


def restore_to_batch(
    namespace: str,
    target: str | os.PathLike[str],
    checkpoint: str,
    batch_id: int,
    *,
    server: str | None = None,
    key: str | None = None,
    from_url: str | None = None,
    force: bool = False,
    timeout: float = 900,
    tls_ca: str | None = None,
    tls: bool = False,
) -> str:
    """Rebuild ``namespace`` into ``target`` as it was when batch ``batch_id`` committed.

    ``checkpoint`` is the checkpoint's path inside the namespace (``location.relpath``).
    Runs ``sos restore NAMESPACE TARGET --batch CHECKPOINT:N`` (it stops right after the
    record that made ``CHECKPOINT/commits/N`` exist) against the server (``server`` and
    ``key``), or with ``from_url`` (``s3://bucket/prefix``, ``file:///dir``: the server's
    ``--tier``) from the bucket alone, no server needed (``sos restore --from URL``; the
    store's credentials and endpoint come from the environment, as boto3 reads them).
    Returns the restored checkpoint directory, ready to be copied or mounted for the query
    to resume from. ``tls_ca``: the CA file that verifies a TLS server (``--tls-ca``;
    ``$SOS_TLS_CA`` when not given), ``tls=True``: TLS trusting the system CAs. Raises
    RuntimeError with sos's one-line message and exit code (4: no
    journal in the namespace, 1: batch N not in the journal, the target not empty or the
    bucket unreachable, 3: corrupt or missing data).
    """
    rel = str(getattr(checkpoint, "relpath", checkpoint)).strip("/")
    if from_url is not None:
        if server is not None or key is not None:
            raise ValueError("restore_to_batch: from_url reads the bucket alone: give it without server= and key=")
        source = ["--from", str(from_url)]
        # neither the server nor a key plays a part (sos refuses --key-file with --from)
        env = {k: v for k, v in os.environ.items() if k not in ("SOS_KEY", "SOS_KEY_FILE")}
    else:
        if not server or key is None:
            raise ValueError("restore_to_batch: server= and key= are needed (or from_url=)")
        source = ["--server", server]
        env = dict(os.environ, SOS_KEY=str(key))  # the key stays off the command line
    cmd = [*sos_command(), "restore", "-q", *source, namespace, str(target), "--batch", f"{rel}:{int(batch_id)}"]
    if force:
        cmd.append("--force")
    if from_url is None and tls_ca:
        cmd += ["--tls-ca", os.fspath(tls_ca)]
    elif from_url is None and tls:
        cmd.append("--tls")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"sos restore failed ({proc.returncode}): {proc.stderr.strip()}")
    return os.path.join(str(target), rel)
