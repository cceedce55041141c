"""The read-only answers of the WebHDFS namespace: they look at the cache and change nothing.

GETFILESTATUS, LISTSTATUS(_BATCH), GETCONTENTSUMMARY, GETFILEBLOCKLOCATIONS,
GETFILECHECKSUM (HDFS's MD5-of-MD5-of-CRC32C computed from the cache), GETSTATUS, the trash
roots, CHECKACCESS and the descriptor OPEN streams from, as
:class:`ReadOperations`, a part of :class:`~spark_plugin.gateway.webhdfs.namespace.WebHdfsNamespace`
(:mod:`spark_plugin.gateway.webhdfs.core` holds what they stand on). None takes the
namespace's lock nor waits for the journal: reads never wait for the writer.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat as stat_mod
import struct
from typing import Any

from sos_journal.format.records import validate_path
from sos_wire.crc import crc32c_compiled  # without crc32c()'s Python frame: one call per 512 bytes
from spark_plugin.gateway.webhdfs.core import NamespaceCore
from spark_plugin.gateway.webhdfs.hdfs import (
    BLOCK_SIZE,
    WebHdfsError,
    file_status,
    file_status_json,
    hard_link,
    hdfs_path,
    illegal,
    not_found,
)

__all__ = ["BLOCK_HOST", "BLOCK_NAME", "BYTES_PER_CRC", "LIST_BATCH", "REPLICATED", "ReadOperations"]

#: bytes per CRC of HDFS's block checksums (dfs.bytes-per-checksum), GETFILECHECKSUM's unit
BYTES_PER_CRC = 512
#: the one host of every block: a filesystem without locality (Hadoop's filesystem
#: specification, FileSystem.getFileBlockLocations' default: localhost, port 9866)
BLOCK_HOST = "localhost"
BLOCK_NAME = "localhost:9866"
#: ContentSummary.ecPolicy of a file with no erasure-coding policy (HDFS's name for it); a
#: directory without a policy has "" (HDFS's ContentSummaryComputationContext)
REPLICATED = "Replicated"
#: GETFILECHECKSUM reads the file in pieces of this size (a multiple of BYTES_PER_CRC)
CHECKSUM_PIECE = 1 << 20
#: LISTSTATUS_BATCH entries per reply (HDFS's dfs.ls.limit default)
LIST_BATCH = 1000


class ReadOperations(NamespaceCore):
    """The read-only answers (module docstring)."""

    def get_file_status(self, rel: str) -> dict:
        st, children = self._status_of(rel)
        return {"FileStatus": file_status(st, "", self.owner, self.group, children)}

    def file_status_body(self, rel: str) -> bytes:
        """:meth:`get_file_status`'s document as the reply's JSON bytes (the gateway's read lane)."""
        st, children = self._status_of(rel)
        return file_status_json(st, self.owner, self.group, children)

    def _status_of(self, rel: str) -> tuple[os.stat_result, int | None]:
        """lstat of ``rel`` (404 unless a directory or a regular file) and, for a directory,
        its number of entries (HDFS's childrenNum)."""
        at = self._walk()  # (what _cache yields, without its context manager: every request's)
        try:
            st = self._require(rel, at)
            children = None
            if stat_mod.S_ISDIR(st.st_mode):
                try:
                    children = len(at.listdir(rel))
                except OSError:
                    children = 0
        finally:
            at.close()
        return st, children

    def _entries(self, rel: str) -> list[dict]:
        with self._cache() as at:
            st = self._require(rel, at)
            if not stat_mod.S_ISDIR(st.st_mode):
                return [file_status(st, "", self.owner, self.group)]
            out = []
            try:
                names = at.listdir(rel)
                dfd = at.dir_fd(rel)
            except (FileNotFoundError, NotADirectoryError):
                raise not_found(hdfs_path(rel)) from None
            for name in names:
                try:
                    est = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while listing
                if stat_mod.S_ISDIR(est.st_mode) or stat_mod.S_ISREG(est.st_mode):
                    out.append(file_status(est, name, self.owner, self.group))
        out.sort(key=lambda d: d["pathSuffix"].encode("utf-8", "surrogateescape"))
        return out

    def list_status(self, rel: str) -> dict:
        return {"FileStatuses": {"FileStatus": self._entries(rel)}}

    def list_status_batch(self, rel: str, start_after: str) -> dict:
        entries = self._entries(rel)
        if start_after:
            key = start_after.encode("utf-8", "surrogateescape")
            entries = [e for e in entries if e["pathSuffix"].encode("utf-8", "surrogateescape") > key]
        page, rest = entries[:LIST_BATCH], entries[LIST_BATCH:]
        return {
            "DirectoryListing": {
                "partialListing": {"FileStatuses": {"FileStatus": page}},
                "remainingEntries": len(rest),
            }
        }

    def content_summary(self, rel: str) -> dict:
        files = dirs = length = 0
        with self._cache() as at:
            st = self._require(rel, at)
            if stat_mod.S_ISDIR(st.st_mode):
                try:
                    for _dir, _subdirs, entries in at.walk(rel):
                        dirs += 1
                        for _name, est in entries:
                            if stat_mod.S_ISREG(est.st_mode):
                                files += 1
                                length += est.st_size
                except (FileNotFoundError, NotADirectoryError):
                    pass  # changed while summed up: HDFS does not lock either
            else:
                files, length = 1, st.st_size
        ec_policy = "" if stat_mod.S_ISDIR(st.st_mode) else REPLICATED
        return {
            "ContentSummary": {
                "directoryCount": dirs,
                "ecPolicy": ec_policy,
                "fileCount": files,
                "length": length,
                "quota": -1,
                "spaceConsumed": length,
                "spaceQuota": -1,
                "typeQuota": {},
            }
        }

    def block_locations(self, rel: str, offset: int, length: int | None) -> dict:
        """GETFILEBLOCKLOCATIONS: one BlockLocation per BLOCK_SIZE block of the file that
        overlaps [offset, offset + length) (the block holding ``offset`` at least, as HDFS's
        BlockManager gives it even for length 0), each on BLOCK_HOST: the filesystem
        specification's answer for a filesystem without locality. None past the end, none
        for an empty file; a directory is refused as HDFS refuses it (Path is not a file)."""
        if offset < 0:
            raise WebHdfsError(
                "HadoopIllegalArgumentException", f"Negative offset is not supported. File: {hdfs_path(rel)}"
            )
        if length is not None and length < 0:
            raise WebHdfsError(
                "HadoopIllegalArgumentException", f"Negative length is not supported. File: {hdfs_path(rel)}"
            )
        size = self._require_file(rel).st_size
        end = size if length is None else min(size, offset + length)
        blocks: list[dict[str, Any]] = []
        start = offset - offset % BLOCK_SIZE
        while offset < size and start < size and (start < end or not blocks):
            blocks.append(
                {
                    "cachedHosts": [],
                    "corrupt": False,
                    "hosts": [BLOCK_HOST],
                    "length": min(BLOCK_SIZE, size - start),
                    "names": [BLOCK_NAME],
                    "offset": start,
                    "storageIds": [],
                    "storageTypes": ["DISK"],
                    "topologyPaths": [],
                }
            )
            start += BLOCK_SIZE
        return {"BlockLocations": {"BlockLocation": blocks}}

    def file_checksum(self, rel: str) -> dict:
        """GETFILECHECKSUM: HDFS's MD5MD5CRC32FileChecksum of a replicated file, computed as
        a DataNode and DFSClient compute it (MD5MD5CRC combine mode, CRC32C): for each
        BLOCK_SIZE block the MD5 of its chunk CRCs (CRC32C of every BYTES_PER_CRC bytes,
        the last chunk short, 4 bytes big-endian each, as in the block's meta file), then
        the MD5 of those MD5s. crcPerBlock is the first block's CRC count when the file has
        more than one block, else 0 (FileChecksumHelper). An empty file has no block and no
        checksum of blocks: HDFS gives it the "magic entry" of earlier versions, the CRC32
        (gzip) checksum with bytesPerCRC 0, crcPerBlock 0 and the MD5 of 32 zero bytes
        (FileChecksumHelper.FileChecksumComputer.compute)."""
        fd, _start, count = self.open_for_read(rel, 0, None)
        try:
            if count == 0:
                raw = bytes(12) + hashlib.md5(bytes(32), usedforsecurity=False).digest()
                return {"FileChecksum": {"algorithm": "MD5-of-0MD5-of-0CRC32", "bytes": raw.hex(), "length": len(raw)}}
            file_md5 = hashlib.md5(usedforsecurity=False)  # of the blocks' MD5s
            blocks = 0
            for block_start in range(0, count, BLOCK_SIZE):
                block_end = min(count, block_start + BLOCK_SIZE)
                crcs = bytearray()
                pos = block_start
                while pos < block_end:
                    piece = os.pread(fd, min(CHECKSUM_PIECE, block_end - pos), pos)
                    if not piece:
                        raise WebHdfsError("IOException", f"{hdfs_path(rel)} shrank while its checksum was computed")
                    view = memoryview(piece)
                    sums = [crc32c_compiled(view[i : i + BYTES_PER_CRC], 0) for i in range(0, len(view), BYTES_PER_CRC)]
                    crcs += struct.pack(f">{len(sums)}I", *sums)
                    pos += len(piece)
                file_md5.update(hashlib.md5(crcs, usedforsecurity=False).digest())
                blocks += 1
        finally:
            os.close(fd)
        crc_per_block = -(-BLOCK_SIZE // BYTES_PER_CRC) if blocks > 1 else 0
        raw = BYTES_PER_CRC.to_bytes(4, "big") + crc_per_block.to_bytes(8, "big") + file_md5.digest()
        return {
            "FileChecksum": {
                "algorithm": f"MD5-of-{crc_per_block}MD5-of-{BYTES_PER_CRC}CRC32C",
                "bytes": raw.hex(),
                "length": len(raw),
            }
        }

    def fs_status(self) -> dict:
        """GETSTATUS: capacity, used and remaining bytes of the gateway's cache filesystem
        (statvfs): the SOS server tells a client neither its quota nor its disk."""
        sv = os.statvfs(self.root)
        return {
            "FsStatus": {
                "capacity": sv.f_blocks * sv.f_frsize,
                "remaining": sv.f_bavail * sv.f_frsize,
                "used": (sv.f_blocks - sv.f_bfree) * sv.f_frsize,
            }
        }

    @staticmethod
    def trash_root(user: str) -> dict:
        """GETTRASHROOT: /user/USER/.Trash, as HDFS outside an encryption zone."""
        return {"Path": f"/user/{user}/.Trash"}

    def trash_roots(self, user: str, all_users: bool) -> dict:
        """GETTRASHROOTS: the trash directories that exist (/user/*/.Trash for all users,
        else the caller's), as HDFS's DistributedFileSystem.getTrashRoots lists them, in the
        FileStatus form JsonUtil gives that list."""
        paths = []
        with self._cache() as at:
            if all_users:
                st = self._stat("user", at)
                users = sorted(at.listdir("user")) if st is not None and stat_mod.S_ISDIR(st.st_mode) else []
            else:
                users = [user]
            for name in users:
                rel = f"user/{name}/.Trash"
                try:
                    validate_path(rel)
                except ValueError:
                    continue
                tst = self._stat(rel, at)
                if tst is None or not stat_mod.S_ISDIR(tst.st_mode):
                    continue
                paths.append(
                    {
                        "path": hdfs_path(rel),
                        "length": 0,
                        "isdir": True,
                        "block_replication": 0,
                        "blocksize": 0,
                        "modification_time": tst.st_mtime_ns // 1_000_000,
                        "access_time": tst.st_atime_ns // 1_000_000,
                        "permission": format(stat_mod.S_IMODE(tst.st_mode) & 0o1777, "o"),
                        "owner": self.owner,
                        "group": self.group,
                    }
                )
        return {"Paths": paths}

    def check_access(self, rel: str, fsaction: str, can_write: bool) -> None:
        self._require(rel)
        if "w" in fsaction and not can_write:
            raise WebHdfsError(
                "AccessControlException",
                f"Permission denied: write access to {hdfs_path(rel)} needs a token of a key with the append role",
            )

    def open_for_read(self, rel: str, offset: int, length: int | None) -> tuple[int, int, int]:
        """(fd, start, count): a snapshot of the file (a later rename or delete does not
        disturb it); the caller closes fd."""
        if offset < 0:
            raise illegal(f'Invalid value for webhdfs parameter "offset": {offset} < 0')
        if length is not None and length < 0:
            raise illegal(f'Invalid value for webhdfs parameter "length": {length} < 0')
        with self._cache() as at:
            self._require_file(rel, at)
            try:
                # O_NOFOLLOW from the parent's descriptor; a regular file with one link
                fd = at.open_file(rel, os.O_RDONLY, single_link=True)
            except OSError as exc:
                if exc.errno == errno.EMLINK:
                    raise hard_link(rel) from None
                if exc.errno in (errno.EACCES, errno.EPERM):
                    raise WebHdfsError(
                        "AccessControlException", f"Permission denied: {hdfs_path(rel)}: {exc.strerror}"
                    ) from None
                raise not_found(hdfs_path(rel)) from None  # gone, or swapped for a link
        st = os.fstat(fd)
        if offset > st.st_size:  # HDFS's DataNode: DFSInputStream.seek refuses it
            os.close(fd)
            raise WebHdfsError("EOFException", "Cannot seek after EOF")
        start = min(offset, st.st_size)
        count = st.st_size - start
        if length is not None:
            count = min(count, length)
        self.inflight.read(rel)  # a driver reading offsets/N runs batch N again (inflight.py)
        return fd, start, count
