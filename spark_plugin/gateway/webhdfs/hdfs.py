"""HDFS's vocabulary, without state: what the gateway's answers are made of.

The refusals (:class:`WebHdfsError`: HTTP status, Java exception class and message, and the
``{"RemoteException": {...}}`` document HDFS sends, :func:`remote_exception`), the Java
exception of each errno, the translation between HDFS paths and the namespace's relative
paths (:func:`hdfs_path`, :func:`rel_path`), WebHDFS's ``permission=`` and what SETPERMISSION
gives (:func:`parse_permission`, :func:`effective_permission`), and the FileStatus JSON
object (:func:`file_status`). No cache, no journal, no HTTP: the namespace
(:mod:`spark_plugin.gateway.webhdfs.namespace`), the HTTP layer and the lease all use them.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat as stat_mod
from typing import Any

from sos_journal.format.records import validate_path

__all__ = [
    "BLOCK_SIZE",
    "EXCEPTION_OF_ERRNO",
    "JAVA_CLASSES",
    "SETPERMISSION_MASK",
    "WebHdfsError",
    "effective_permission",
    "file_status",
    "file_status_json",
    "hard_link",
    "hdfs_path",
    "illegal",
    "not_found",
    "parse_permission",
    "redact_query",
    "rel_path",
    "remote_exception",
]

#: query parameters whose values a log line never shows: credentials a client may put in a
#: URL (a key as client_secret, a token as access_token or delegation, a password)
_SECRET_PARAM = re.compile(r"(?i)([^&=]*(?:secret|token|delegation|password|credential|key)[^&=]*=)[^&]*")


def redact_query(query: str) -> str:
    """``query`` (a request's, as sent) with the value of every credential-like parameter
    replaced by ``<redacted>``: for the request log, which must never hold a key."""
    return _SECRET_PARAM.sub(r"\1<redacted>", query)


#: Java class of each exception the gateway reports, and the HTTP status HDFS gives it
#: (ExceptionHandler: FileNotFoundException 404, other IOExceptions 403,
#: IllegalArgumentException and UnsupportedOperationException 400, anything else 500).
JAVA_CLASSES: dict[str, tuple[str, int]] = {
    "FileNotFoundException": ("java.io.FileNotFoundException", 404),
    "FileAlreadyExistsException": ("org.apache.hadoop.fs.FileAlreadyExistsException", 403),
    "ParentNotDirectoryException": ("org.apache.hadoop.fs.ParentNotDirectoryException", 403),
    "PathIsNotEmptyDirectoryException": ("org.apache.hadoop.fs.PathIsNotEmptyDirectoryException", 403),
    "AlreadyBeingCreatedException": ("org.apache.hadoop.hdfs.protocol.AlreadyBeingCreatedException", 403),
    "DSQuotaExceededException": ("org.apache.hadoop.hdfs.protocol.DSQuotaExceededException", 403),
    "RetriableException": ("org.apache.hadoop.ipc.RetriableException", 403),
    "AccessControlException": ("org.apache.hadoop.security.AccessControlException", 403),
    "IOException": ("java.io.IOException", 403),
    "EOFException": ("java.io.EOFException", 403),
    "IllegalArgumentException": ("java.lang.IllegalArgumentException", 400),
    "HadoopIllegalArgumentException": ("org.apache.hadoop.HadoopIllegalArgumentException", 400),
    "UnsupportedOperationException": ("java.lang.UnsupportedOperationException", 400),
}

#: the block size FileStatus reports and the block answers (GETFILEBLOCKLOCATIONS, GETFILECHECKSUM) use
BLOCK_SIZE = 128 << 20


def remote_exception(exception: str, message: str, java_class: str | None = None) -> dict:
    """The JSON document HDFS sends for a refusal."""
    if java_class is None:
        java_class = JAVA_CLASSES.get(exception, ("java.io.IOException", 500))[0]
    return {"RemoteException": {"exception": exception, "javaClassName": java_class, "message": message}}


class WebHdfsError(Exception):
    """A refusal: HTTP ``status``, Java ``exception`` (simple name) and ``message``."""

    def __init__(self, exception: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        known = JAVA_CLASSES.get(exception)
        self.exception = exception
        self.java_class = known[0] if known else "java.io.IOException"
        self.status = status if status is not None else (known[1] if known else 500)
        self.message = message

    def body(self) -> dict:
        return remote_exception(self.exception, self.message, self.java_class)


#: The Java exception of a refused mutation, by the errno of its OSError (else IOException).
EXCEPTION_OF_ERRNO = {
    errno.EACCES: "AccessControlException",
    errno.EPERM: "AccessControlException",
    errno.ENOENT: "FileNotFoundException",
    errno.EEXIST: "FileAlreadyExistsException",
    errno.ENOTDIR: "ParentNotDirectoryException",
    errno.ENOTEMPTY: "PathIsNotEmptyDirectoryException",
    errno.EDQUOT: "DSQuotaExceededException",
}

#: SETPERMISSION keeps these bits of the mode asked for: no setuid, setgid or sticky bit and
#: no write for group or others (other local users must not change the gateway's cache).
SETPERMISSION_MASK = 0o755


def not_found(path: str) -> WebHdfsError:
    return WebHdfsError("FileNotFoundException", f"File does not exist: {path}")


def hard_link(rel: str) -> WebHdfsError:
    return WebHdfsError(
        "AccessControlException",
        f"Permission denied: {hdfs_path(rel)} has more than one hard link; the "
        f"journal never makes one, so another name of it may be outside the "
        f"cache: refused",
    )


def illegal(message: str) -> WebHdfsError:
    return WebHdfsError("IllegalArgumentException", message)


def hdfs_path(rel: str) -> str:
    """The absolute HDFS path of a namespace-relative path ("" is "/")."""
    return "/" + rel


def rel_path(path: str) -> str:
    """An absolute HDFS path ("/a/b", already percent-decoded) -> "a/b" ("/" -> "").

    Empty segments collapse (as HDFS's Path does); "." and ".." are refused
    (IllegalArgumentException, as DFSUtil.isValidName refuses them)."""
    if not path.startswith("/"):
        raise illegal(f"Invalid path name {path}: a WebHDFS path must be absolute")
    parts = [p for p in path.split("/") if p]
    for p in parts:
        if p in (".", "..") or "\x00" in p:
            raise illegal(f"Invalid path name {path}")
    rel = "/".join(parts)
    if rel:
        try:
            validate_path(rel)
        except ValueError as exc:
            raise illegal(f"Invalid path name {path}: {exc}") from None
    return rel


def effective_permission(mode: int, is_dir: bool) -> int:
    """The mode SETPERMISSION gives: ``mode & SETPERMISSION_MASK``, and never less than
    u+rwx for a directory or u+rw for a file, so that the gateway (root or not) can still
    use its own cache: 0777 gives 0755, 000 gives 0700 on a directory (the root included)
    and 0600 on a file."""
    return (mode & SETPERMISSION_MASK) | (0o700 if is_dir else 0o600)


def parse_permission(text: str | None, default: int) -> int:
    """WebHDFS ``permission=`` (octal, e.g. "755"; up to 1777) -> mode bits."""
    if text is None or text == "":
        return default
    try:
        mode = int(text, 8)
    except ValueError:
        raise illegal(f'Invalid value for webhdfs parameter "permission": {text!r} is not an octal number') from None
    if not 0 <= mode <= 0o1777:
        raise illegal(f'Invalid value for webhdfs parameter "permission": {text} is out of the range [0, 1777]')
    return mode & 0o777  # the journal keeps rwx bits only


def file_status(st: os.stat_result, suffix: str, owner: str, group: str, children: int | None = None) -> dict[str, Any]:
    """An HDFS FileStatus JSON object (JsonUtil.toJsonMap's field names and types)."""
    is_dir = stat_mod.S_ISDIR(st.st_mode)
    doc: dict[str, Any] = {
        "accessTime": st.st_atime_ns // 1_000_000,
        "blockSize": 0 if is_dir else BLOCK_SIZE,
        "fileId": st.st_ino,
        "group": group,
        "length": 0 if is_dir else st.st_size,
        "modificationTime": st.st_mtime_ns // 1_000_000,
        "owner": owner,
        "pathSuffix": suffix,
        "permission": format(stat_mod.S_IMODE(st.st_mode) & 0o1777, "o"),
        "replication": 0 if is_dir else 1,
        "storagePolicy": 0,
        "type": "DIRECTORY" if is_dir else "FILE",
    }
    if children is not None:
        doc["childrenNum"] = children
    return doc


#: :func:`file_status_json`'s document, as the gateway's JSON encoder writes it (compact, keys
#: in file_status's order, strings ASCII-escaped)
_STATUS_JSON = (
    b'{"FileStatus":{"accessTime":%d,"blockSize":%d,"fileId":%d,"group":%s,"length":%d,'
    b'"modificationTime":%d,"owner":%s,"pathSuffix":"","permission":"%s","replication":%d,'
    b'"storagePolicy":0,"type":"%s"%s}}'
)


@functools.lru_cache(maxsize=64)
def _json_string(text: str) -> bytes:
    return json.dumps(text).encode()


def file_status_json(st: os.stat_result, owner: str, group: str, children: int | None = None) -> bytes:
    """``{"FileStatus": file_status(st, "", owner, group, children)}`` encoded as the gateway's
    JSON encoder encodes it, byte for byte, without building the document (GETFILESTATUS)."""
    is_dir = stat_mod.S_ISDIR(st.st_mode)
    return _STATUS_JSON % (
        st.st_atime_ns // 1_000_000,
        0 if is_dir else BLOCK_SIZE,
        st.st_ino,
        _json_string(group),
        0 if is_dir else st.st_size,
        st.st_mtime_ns // 1_000_000,
        _json_string(owner),
        format(stat_mod.S_IMODE(st.st_mode) & 0o1777, "o").encode(),
        0 if is_dir else 1,
        b"DIRECTORY" if is_dir else b"FILE",
        b"" if children is None else b',"childrenNum":%d' % children,
    )
