"""Run a command as a container with a read-only root filesystem would run it (tests only).

Started by tests/deploy/test_gateway.py as root as

    unshare --mount --propagation private python tests/deploy/ro_sandbox.py SPEC.json

so that every mount change below happens in a new, private mount namespace: the host's
mounts are never touched (it refuses to go on in its parent's namespace). Then:

1. ``reveal``: directories below a parent that other users cannot traverse (e.g. a Python
   under /root, mode 0700) are moved onto a tmpfs (mode 0755) laid over that parent;
2. ``writable``: each directory is bound onto itself, a mount of its own (the emptyDirs,
   volumes of a pod);
3. every other mount except /proc, /sys and /dev (as in a container) is made read-only:
   MS_BIND | MS_REMOUNT | MS_RDONLY, a per-mount flag of this namespace's copy only;
4. ``must_fail``: creating a file there must now fail with EROFS, even as root;
5. exec ``argv`` (as given: the caller puts strace/setpriv in front) with exactly ``env``
   in ``cwd``.

Exit status 3 with a message on stderr if any step fails.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE = 32, 1024, 2048, 4096, 8192
MS_REC, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 21, 1 << 24
_PER_MOUNT = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
_CONTAINER_OWN = ("/proc", "/sys", "/dev")

_libc = ctypes.CDLL(None, use_errno=True)


def _enc(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = _enc
    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}", target)


def _unescape(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, per-mount options) of this namespace, in mount order."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            out.append((_unescape(fields[4]), fields[5]))
    return out


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    if os.readlink("/proc/self/ns/mnt") == os.readlink(f"/proc/{os.getppid()}/ns/mnt"):
        print("ro_sandbox: not in a mount namespace of its own: refusing to remount", file=sys.stderr)
        return 3
    try:
        for i, path in enumerate(spec.get("reveal", [])):
            parent, name = os.path.split(path.rstrip("/"))
            stage = os.path.join(spec["stage"], str(i))
            os.makedirs(stage, exist_ok=True)
            _mount(path, stage, None, MS_BIND | MS_REC)
            _mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
            os.mkdir(os.path.join(parent, name), 0o755)
            _mount(stage, os.path.join(parent, name), None, MS_MOVE)
        writable = tuple(os.path.realpath(w) for w in spec["writable"])
        for path in writable:
            _mount(path, path, None, MS_BIND)
        for target, options in _mounts():
            if _under(target, _CONTAINER_OWN) or target in writable:
                continue
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY
            for opt in options.split(","):
                flags |= _PER_MOUNT.get(opt, 0)
            try:
                _mount(None, target, None, flags)
            except FileNotFoundError:
                continue  # hidden below a later mount
        for path in spec.get("must_fail", []):
            probe = os.path.join(path, ".ro-sandbox-probe")
            try:
                fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError as exc:
                if exc.errno != errno.EROFS:
                    raise
            else:
                os.close(fd)
                os.unlink(probe)
                print(f"ro_sandbox: {path} is still writable", file=sys.stderr)
                return 3
    except OSError as exc:
        print(f"ro_sandbox: {exc}", file=sys.stderr)
        return 3
    os.chdir(spec.get("cwd", "/"))
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
    return 3  # not reached


if __name__ == "__main__":
    sys.exit(main())
