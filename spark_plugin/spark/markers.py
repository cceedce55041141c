"""Batch markers: after each committed micro-batch, a MARKER ``spark.batch`` record that names
the query and the batch in the journal (``sos restore`` lists them when asked for a batch it
cannot find; restoring to a batch does not depend on them). :class:`MarkerListener` writes it
through a mount's control file, :class:`GatewayMarkerListener` through the gateway's
``POST /sos/v1/marker``; both are Spark ``StreamingQueryListener`` s when pyspark is there."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from .names import MARKER_CONTROL, MARKER_LABEL

if TYPE_CHECKING:
    from pyspark.sql.streaming.listener import (
        QueryIdleEvent,
        QueryProgressEvent,
        QueryStartedEvent,
        QueryTerminatedEvent,
    )

    from spark_plugin.gateway.client import GatewayClient

log = logging.getLogger(__name__)

#: a marker listener that cannot reach the gateway warns once, then at most this often (s)
MARKER_WARN_INTERVAL = 60.0

_ListenerBase: type
try:  # pyspark is an optional extra; the helpers that do not need it work without it
    from pyspark.sql.streaming import StreamingQueryListener

    _ListenerBase = StreamingQueryListener
except ImportError:  # pragma: no cover - exercised only without the spark extra
    _ListenerBase = object


def marker_payload(checkpoint_relpath: str, query_id: object, batch_id: int) -> bytes:
    """The MARKER payload for a committed batch (names the query and batch in the journal)."""
    return json.dumps(
        {"checkpoint": checkpoint_relpath, "query_id": str(query_id), "batch_id": int(batch_id)}, sort_keys=True
    ).encode()


def write_marker(mountpoint: str, checkpoint_relpath: str, query_id: object, batch_id: int) -> bool:
    """Write a ``spark.batch`` marker through the mount's control file.

    Returns False (and writes nothing) when the mount offers no control file.
    """
    control = os.path.join(mountpoint, MARKER_CONTROL)
    if not os.path.exists(control):
        return False
    doc = {"label": MARKER_LABEL, "payload": json.loads(marker_payload(checkpoint_relpath, query_id, batch_id))}
    data = json.dumps(doc, sort_keys=True).encode()
    fd = os.open(control, os.O_WRONLY)
    try:
        os.write(fd, data)
        os.fsync(fd)  # the mount makes the marker durable before fsync returns (sync mode)
    finally:
        os.close(fd)
    return True


class _BatchMarkerListener(_ListenerBase):
    """What both marker listeners share: after each progress event of the query (or of
    ``query_name`` only), if ``commits/N`` exists (:meth:`_committed`), write the batch's
    MARKER (:meth:`_write_marker`) and note N in ``written``; a failure goes to ``errors``
    (and :meth:`_failed`), never to the query. Subclasses set ``relpath`` and say where
    the checkpoint lives (a mount or a gateway)."""

    def __init__(self, *, query_name: str | None) -> None:
        super().__init__()
        self.query_name = query_name
        self.written: list[int] = []
        self.errors: list[str] = []

    def _committed(self, batch_id: int) -> bool:
        raise NotImplementedError

    def _write_marker(self, query_id: object, batch_id: int) -> bool:
        """Write the marker; False when it could not be written (and that is no error)."""
        raise NotImplementedError

    def _failed(self, exc: BaseException) -> None:
        """Say that a marker failed (it is already in ``errors``)."""

    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        pass

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        try:
            progress = event.progress
            if self.query_name is not None and progress.name != self.query_name:
                return
            batch_id = int(progress.batchId)
            if self._committed(batch_id) and self._write_marker(progress.id, batch_id):
                self.written.append(batch_id)
        except Exception as exc:  # noqa: BLE001 - a listener must never break the query
            self.errors.append(repr(exc))
            self._failed(exc)

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        pass

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        pass


class MarkerListener(_BatchMarkerListener):
    """Writes a MARKER ``spark.batch`` record after each committed micro-batch.

    ``checkpoint``: the query's checkpointLocation on a mount (a :class:`CheckpointLocation`
    from :func:`journaled_checkpoint`, or a path with ``mountpoint=`` given). Spark calls
    ``onQueryProgress`` after ``commits/N`` exists; the listener checks that file before
    writing, so a marker never names an uncommitted batch. ``query_name`` restricts it to
    one query when the session runs several.
    """

    def __init__(self, checkpoint: str, *, mountpoint: str | None = None, query_name: str | None = None) -> None:
        super().__init__(query_name=query_name)
        mountpoint = mountpoint or getattr(checkpoint, "mountpoint", "")
        if not mountpoint:
            raise ValueError("MarkerListener needs the mount point of the checkpoint")
        self.checkpoint = os.path.abspath(str(checkpoint))
        self.mountpoint = os.path.abspath(mountpoint)
        rel = os.path.relpath(self.checkpoint, self.mountpoint)
        if rel.startswith(".."):
            raise ValueError(f"checkpoint {checkpoint} is not under {mountpoint}")
        self.relpath = "" if rel == "." else rel
        self._missing_control_logged = False

    def _committed(self, batch_id: int) -> bool:
        return os.path.exists(os.path.join(self.checkpoint, "commits", str(batch_id)))

    def _write_marker(self, query_id: object, batch_id: int) -> bool:
        if write_marker(self.mountpoint, self.relpath, query_id, batch_id):
            return True
        if not self._missing_control_logged:
            self._missing_control_logged = True
            log.warning("mount %s has no %s: batch markers are not written", self.mountpoint, MARKER_CONTROL)
        return False

    def _failed(self, exc: BaseException) -> None:
        log.exception("writing the batch marker failed")


class GatewayLocation(Protocol):
    """What :class:`GatewayMarkerListener` reads of its checkpoint (a
    :class:`~spark_plugin.spark.gateway.GatewayCheckpoint`)."""

    relpath: str

    def client(self) -> GatewayClient: ...


class GatewayMarkerListener(_BatchMarkerListener):
    """:class:`MarkerListener` for a checkpoint on the gateway: after each committed batch
    (``commits/N`` exists on the gateway) it appends the same ``spark.batch`` MARKER record
    through ``POST /sos/v1/marker``, durable when the gateway answers (sync mode)."""

    def __init__(
        self, checkpoint: GatewayLocation, *, query_name: str | None = None, client: GatewayClient | None = None
    ) -> None:
        super().__init__(query_name=query_name)
        self.relpath = checkpoint.relpath
        self._client = client or checkpoint.client()
        self._warned_at: float | None = None
        self._unreported = 0

    def _committed(self, batch_id: int) -> bool:
        commit = f"{self.relpath}/commits/{batch_id}" if self.relpath else f"commits/{batch_id}"
        return self._client.exists(commit)

    def _write_marker(self, query_id: object, batch_id: int) -> bool:
        self._client.marker(MARKER_LABEL, marker_payload(self.relpath, query_id, batch_id))
        return True

    def _failed(self, exc: BaseException) -> None:
        self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        """One warning line, then at most one per MARKER_WARN_INTERVAL (with the count of
        failures since), never a traceback per batch: the markers only label batches, and
        restoring to a batch does not need them."""
        now = time.monotonic()
        self._unreported += 1
        if self._warned_at is not None and now - self._warned_at < MARKER_WARN_INTERVAL:
            return
        since = f" ({self._unreported} failures since the last warning)" if self._warned_at is not None else ""
        log.warning(
            "batch markers are not being written through the gateway %s: %s%s; the query "
            "goes on (sos restore --batch works without markers; they only label batches)",
            self._client.url,
            exc,
            since,
        )
        self._warned_at = now
        self._unreported = 0
