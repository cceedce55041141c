"""The FUSE mount's test helpers: renameat2, fsync of a directory (:func:`durable`), file
operations run as another user (:func:`as_user`, :func:`run_as`), a mount fixture's teardown
(:func:`stop_mounts`)."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys

import pytest

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
RENAME_NOREPLACE = 1


def renameat2(src, dst, flags: int = RENAME_NOREPLACE) -> None:
    """renameat2(2) of ``src`` onto ``dst`` (default RENAME_NOREPLACE: what Hadoop's local FS
    does for a rename that must not overwrite); OSError with the errno if it fails."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), dst)


def durable(mountpoint):
    """fsync of a directory on the mount (FSYNCDIR): returns once every record is on the server.

    Needed before a restore when the last operations were not barriered (unlink,
    mkdir, rmdir return before the server has them, like on any filesystem).
    """
    fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AS_USER = r"""
import json, os, sys
out = {"uid": os.getuid(), "groups": os.getgroups()}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = exc.errno
def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
def read(path):
    with open(path, "rb") as f:
        out["data:" + path] = f.read().decode()
for step in json.loads(sys.argv[1]):
    op, args = step[0], step[1:]
    fn = {"mkdir": os.mkdir, "write": lambda p, d: write(p, d.encode()), "read": read,
          "rename": os.rename, "unlink": os.unlink, "chmod": os.chmod,
          "chown": lambda p, u: os.chown(p, u, -1)}[op]
    attempt(":".join(map(str, step)), lambda: fn(*args))
print(json.dumps(out))
"""


def world_python():
    """A Python interpreter any user may run (pytest's may live under root's 0700 home)."""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(cand)
        parts = [real, os.path.dirname(real)]
        while parts[-1] != "/":
            parts.append(os.path.dirname(parts[-1]))
        if os.path.isfile(real) and all(os.path.exists(p) and os.stat(p).st_mode & stat.S_IXOTH for p in parts):
            return real
    pytest.skip("no Python interpreter that a non-root user may run")


def as_user(uid, cwd, *steps):
    """Run file operations as `uid` (gid = uid, no supplementary groups) in `cwd`.

    Paths are relative to `cwd` (chdir happens before the process drops root, so the
    0700 pytest directories above the mount point need not be traversable)."""
    out = run_as(uid, cwd, _AS_USER, json.dumps(steps))
    assert out["uid"] == uid and out["groups"] == []
    return out


def run_as(uid: int, cwd: str, script: str, *args: str) -> dict:
    """Run the Python ``script`` (with ``args``) as `uid` (gid = uid, no supplementary groups)
    in `cwd`; it must exit 0; what it printed, read as JSON."""
    proc = subprocess.run(
        [world_python(), "-I", "-c", script, *args],
        cwd=cwd,
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def stop_mounts(started) -> None:
    """A mount fixture's teardown: kill each of ``started`` (MountProcess) still running and
    lazily unmount its mount point."""
    for mp in started:
        try:
            if mp.proc is not None and mp.proc.poll() is None:
                mp.kill()
        finally:
            subprocess.run(["fusermount3", "-u", "-z", mp.mountpoint], capture_output=True)
