"""A local user of a root `sos mount --owner` against root (issue 9, items 1 and 8).

A real sos-server, a real mount process running as root (the sidecar), a real user
(uid 185, Spark's) writing through it, and `sos restore` run as root afterwards:

* item 1: a file created 04755 (and a directory 03777) through the mount must not come back
  from the journal as a root-owned setuid file: the journal records the modes masked, and
  restore applies at most mode & 0o775 whatever a record says;
* item 8: the mount's cache directory is private (0700, root's): the owner of the tree
  cannot reach it to plant links for the root daemon to follow.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile

import pytest

pytest.importorskip("pyfuse3")

from spark_plugin.mount.process import MountProcess
from tests.mount.support import as_user, durable, run_as, stop_mounts

pytestmark = [
    pytest.mark.hostile,
    pytest.mark.fuse,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the sidecar's situation)"),
    pytest.mark.timeout(240),
]

SPARK_UID = 185
NS = "hostile"


@pytest.fixture
def key(sos_server):
    return sos_server.keygen(NS, "append")


@pytest.fixture
def mount(tmp_path, sos_server, key):
    """mount(cache, *args): a started `sos mount --owner 185:185` (stopped at teardown)."""
    started = []

    def make(cache: str) -> MountProcess:
        mp = MountProcess(
            NS,
            str(tmp_path / f"mnt-{len(started)}"),
            cache,
            sos_server.address,
            key,
            log_path=str(tmp_path / f"mount-{len(started)}.log"),
            extra_args=["--owner", f"{SPARK_UID}:{SPARK_UID}"],
        )
        started.append(mp)
        return mp.start()

    yield make
    stop_mounts(started)


_ATTACK = r"""
import json, os
os.mkdir("chk")
os.mkdir("chk/shared", 0o3777)
fd = os.open("chk/evil", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o4755)
os.write(fd, b"#!/bin/sh\nid -u\n")
os.close(fd)
print(json.dumps({"uid": os.getuid()}))
"""


def journal_modes(address: str, key: str) -> dict:
    """{path: mode} of every CREATE/MKDIR record the server holds (all generations)."""
    from sos_client import Client
    from sos_journal.format.records import Create, Mkdir
    from sos_journal.rebuild.restore import generation_records, list_generations

    out: dict = {}
    with Client(address, key, NS) as client:
        for _g, gen in sorted(list_generations(client).items()):
            for rec in generation_records(client, gen):
                if isinstance(rec.op, (Create, Mkdir)):
                    out.setdefault(rec.op.path, []).append(rec.op.mode)
    return out


@pytest.fixture
def open_dir():
    """A directory every user may traverse (pytest's tmp_path is root's 0700), removed after."""
    path = tempfile.mkdtemp(prefix="sos-hostile-mount-")
    os.chmod(path, 0o755)
    yield path
    subprocess.run(["rm", "-rf", "--one-file-system", path], check=False)


def test_a_setuid_file_made_through_the_mount_never_comes_back_setuid_from_restore(
    mount, sos_server, key, tmp_path, open_dir
):
    from sos_client import Client
    from sos_journal.rebuild.restore import restore

    m = mount(os.path.join(open_dir, "cache")).mountpoint
    assert run_as(SPARK_UID, m, _ATTACK)["uid"] == SPARK_UID
    durable(m)
    # the journal never holds a special or world-write bit
    modes = journal_modes(sos_server.address, key)
    assert modes["chk/evil"] and modes["chk/shared"], modes
    for path, ms in modes.items():
        for mode in ms:
            assert not mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWOTH), (path, oct(mode))
    # root restores: a root-owned file, but no setuid bit
    target = tmp_path / "restored"
    restore(lambda: Client(sos_server.address, key, NS), NS, str(target))
    st = os.lstat(target / "chk" / "evil")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    assert stat.S_IMODE(os.lstat(target / "chk" / "shared").st_mode) == 0o755
    assert (target / "chk" / "evil").read_bytes() == b"#!/bin/sh\nid -u\n"


def test_the_owner_of_a_root_mount_cannot_reach_its_cache(mount, open_dir):
    """Item 8: the owner planted links in the cache's tree (its own directory) and the root
    daemon followed them. The cache directory is now root's and 0700, even one that existed
    before with looser permissions."""
    cache = os.path.join(open_dir, "cache")
    os.makedirs(os.path.join(cache, "tree"), mode=0o755)
    os.chmod(cache, 0o755)
    mp = mount(cache)
    st = os.lstat(cache)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
    assert os.lstat(os.path.join(cache, "tree")).st_uid == SPARK_UID  # the mount's root is 185's
    out = as_user(SPARK_UID, open_dir, ["mkdir", "cache/tree/planted"], ["read", "cache/spool/x"])
    assert out["mkdir:cache/tree/planted"] == 13  # EACCES: it cannot even traverse the cache
    assert out["read:cache/spool/x"] == 13
    # through the mount, the owner still works as before
    out = as_user(SPARK_UID, mp.mountpoint, ["mkdir", "chk"], ["write", "chk/f", "x"])
    assert out["mkdir:chk"] == out["write:chk/f:x"] == "ok"
    assert mp.stop() == 0
