"""The verdict: how the harness reads a checkpoint (a local directory, or through the gateway)
and checks it against the output: exactly once for the committed batches, RPO 0, the
dedup state of the last committed batch present."""

from __future__ import annotations

import json
import os
import re

from tools.demo_common import check_output, committed_batches, fmt
from tools.soak.common import SHUFFLE_PARTITIONS, Violation


def source_offset(checkpoint_dir, batch: int) -> int:
    """The file source's log offset recorded in ``offsets/<batch>`` (line 3: {"logOffset": L}).

    ``checkpoint_dir``: a local directory, or a :class:`GatewayView`."""
    if isinstance(checkpoint_dir, GatewayView):
        text = checkpoint_dir.read(f"offsets/{batch}")
    else:
        with open(os.path.join(checkpoint_dir, "offsets", str(batch)), encoding="utf-8") as f:
            text = f.read()
    lines = text.splitlines()
    try:
        return int(json.loads(lines[2])["logOffset"])
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        raise Violation(f"offsets/{batch} of {checkpoint_dir} is unreadable: {lines!r:.300}") from exc


def state_files(checkpoint_dir, rel: str) -> dict[str, int]:
    """{name: size} of the files in ``rel`` of a local checkpoint or a :class:`GatewayView`."""
    if isinstance(checkpoint_dir, GatewayView):
        return checkpoint_dir.sizes(rel)
    d = os.path.join(checkpoint_dir, rel)
    if not os.path.isdir(d):
        return {}
    return {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if os.path.isfile(os.path.join(d, n))}


def checkpoint_commits(checkpoint_dir) -> set[int]:
    """The batch ids in ``commits/`` of a local checkpoint or a :class:`GatewayView`."""
    if isinstance(checkpoint_dir, GatewayView):
        return checkpoint_dir.commits()
    return committed_batches(checkpoint_dir)


class GatewayView:
    """A checkpoint as ``sos gateway`` serves it (what Spark sees): the harness's check reads
    ``commits/`` and ``offsets/N`` over WebHDFS (LISTSTATUS, OPEN) with a bearer token."""

    def __init__(self, url: str, namespace: str, key: str, relpath: str) -> None:
        from spark_plugin.gateway.client import GatewayClient

        self.client = GatewayClient(url, namespace, key, timeout=120)
        self.relpath = relpath.strip("/")

    def __str__(self) -> str:
        return f"{self.client.url}/webhdfs/v1/{self.relpath}"

    def commits(self) -> set[int]:
        from spark_plugin.gateway.client import GatewayError

        try:
            doc = self.client.call("GET", f"/webhdfs/v1/{self.relpath}/commits", op="LISTSTATUS")
        except GatewayError as exc:
            if exc.status == 404:
                return set()
            raise
        return {int(st["pathSuffix"]) for st in doc["FileStatuses"]["FileStatus"] if st["pathSuffix"].isdigit()}

    def sizes(self, rel: str) -> dict[str, int]:
        """{name: length} of the files in ``rel`` ({} if it does not exist)."""
        from spark_plugin.gateway.client import GatewayError

        try:
            doc = self.client.call("GET", f"/webhdfs/v1/{self.relpath}/{rel}", op="LISTSTATUS")
        except GatewayError as exc:
            if exc.status == 404:
                return {}
            raise
        return {st["pathSuffix"]: int(st["length"]) for st in doc["FileStatuses"]["FileStatus"] if st["type"] == "FILE"}

    def read(self, rel: str) -> str:
        import urllib.request

        if len(self.client.urls) > 1:  # a gateway pair: land on the active one first
            self.client.call("GET", f"/webhdfs/v1/{self.relpath}/{rel}", op="GETFILESTATUS")
        url = f"{self.client.url}/webhdfs/v1/{self.relpath}/{rel}?op=OPEN&data=true"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.client.token()}"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.read().decode("utf-8")


class Checks:
    """The check after every restart, as a part of :class:`tools.soak.harness.Soak` (it reads
    the run's input, acknowledgements and output)."""

    # set by Soak
    state_store: str
    fed: int
    file_ids: list[list[int]]
    expected_all: dict[int, str]
    paths: dict[str, str]
    checks: int
    records_checked: int
    last_check_records: int
    last_check_hi: int

    def read_acked(self) -> int:
        raise NotImplementedError

    def check(self, chk_dir: str, label: str) -> str:
        """Committed output == the input prefix of the committed batches; RPO 0."""
        acked = self.read_acked()  # BEFORE listing commits: a later commit only adds
        commits = checkpoint_commits(chk_dir)
        self.checks += 1
        self.last_check_hi = max(commits, default=-1)
        if not commits:
            if acked >= 0:
                raise Violation(
                    f"{label}: no commits in {chk_dir}, but batch {acked} was acknowledged committed (RPO 0 broken)"
                )
            return "no batch committed yet"
        hi, lo = max(commits), min(commits)
        if commits != set(range(lo, hi + 1)):
            raise Violation(f"{label}: commits/ has gaps: {fmt(commits)}")
        if hi < acked:
            raise Violation(
                f"{label}: last commit is batch {hi} but batch {acked} was "
                "acknowledged committed before (RPO 0 broken: a committed batch "
                "was lost)"
            )
        # the file source's log offset L of batch hi: batches 0..hi read files 0..L (one file
        # per source offset, maxFilesPerTrigger=1; a batch re-planned after a crash can span
        # several offsets)
        last_file = source_offset(chk_dir, hi)
        if last_file < hi or last_file >= self.fed:
            raise Violation(f"{label}: batch {hi} ends at input file {last_file}, but {self.fed} files were fed")
        # older commit files are purged by Spark (minBatchesToRetain): every batch up to hi
        # has committed
        committed = set(range(hi + 1))
        prefix = {rid: self.expected_all[rid] for i in range(last_file + 1) for rid in self.file_ids[i]}
        res = check_output(self.paths["out"], committed, prefix)
        problems = [
            f"{len(res[k])} {k.replace('_', ' ')} (e.g. {res[k][:5]})"
            for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output")
            if res[k]
        ]
        if problems or res["records_out"] != len(prefix):
            raise Violation(
                f"{label}: committed batches 0..{hi}: "
                + "; ".join(problems or [f"{res['records_out']} records out, {len(prefix)} expected"])
            )
        if self.state_store == "hdfs":
            self.check_state(chk_dir, hi, label)
        self.records_checked += res["records_out"]
        self.last_check_records = res["records_out"]
        return f"batches 0..{hi} committed (input files 0..{last_file}), {res['records_out']} records exactly once"

    def check_state(self, chk_dir, hi: int, label: str) -> None:
        """The dedup state of committed batch ``hi`` (state version hi+1) is there: in each
        shuffle partition ``state/0/P/`` the delta file of version hi+1 exists, and no delta
        or snapshot file of a committed version is empty (Spark makes each one visible by a
        rename of a complete file; an empty one cannot be loaded)."""
        for part in range(SHUFFLE_PARTITIONS):
            files = state_files(chk_dir, f"state/0/{part}")
            if f"{hi + 1}.delta" not in files:
                raise Violation(f"{label}: batch {hi} committed, but state/0/{part}/{hi + 1}.delta is missing")
            empty = sorted(
                (
                    n
                    for n, size in files.items()
                    if size == 0 and re.fullmatch(r"\d+\.(delta|snapshot)", n) and int(n.split(".")[0]) <= hi + 1
                ),
                key=lambda n: int(n.split(".")[0]),
            )
            if empty:
                raise Violation(
                    f"{label}: batch {hi} committed, but the state files state/0/{part}/{', '.join(empty)} are empty"
                )
