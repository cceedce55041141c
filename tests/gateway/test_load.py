"""bench/load.py (issue 28 item 1): its logic, without timing. The request log it reads, the
batch it takes, the placeholders, the report's arithmetic; and, against a real gateway, that
the checked-in pattern of the small query still fits it (every reply as captured)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import load  # noqa: E402 - bench/ is found from the checkout
from sos_wire.logs import JsonFormatter  # noqa: E402

U0 = "c17f0007-f45e-4cae-9535-a7562565a9b1"
U1 = "4d94a29f-fe36-427e-af4a-63b1b0517d2e"


def _line(method: str, op: str, path: str, status: int, query: str, data: bool = False) -> str:
    flag = " [data]" if data else ""
    return f"2026-11-29 00:47:38,175 sos.gateway DEBUG {method} {op} {path}{flag} -> {status} (1.5 ms) {query}"


def _hadoop(method: str, op: str, path: str, status: int, extra: str = "", data: bool = False) -> str:
    return _line(method, op, "/webhdfs/v1" + path, status, f"op={op}&user.name=root{extra}", data)


def _commit(root: str, n: int, uid: str) -> list[str]:
    tmp = f"{root}/commits/.{n}.{uid}.tmp"
    dest = urllib.parse.quote(f"{root}/commits/{n}", safe="")
    return [
        _hadoop("PUT", "CREATE", tmp, 307, "&overwrite=true"),
        _hadoop("PUT", "CREATE", tmp, 201, "&overwrite=true&data=true", data=True),
        _hadoop("PUT", "RENAME", tmp, 200, f"&destination={dest}&renameoptions=NONE"),
    ]


def _listener(root: str, n: int) -> list[str]:
    return [
        _line("GET", "GETFILESTATUS", f"/webhdfs/v1{root}/commits/{n}", 200, "op=GETFILESTATUS"),
        _line("POST", "-", "/sos/v1/marker", 200, "label=spark.batch"),
    ]


def _log(root: str = "/q/chk") -> str:
    state_tmp = f"{root}/state/0/11/.12.delta.{U1}.TID45.tmp"
    lines = [
        *_commit(root, 10, U0),
        _hadoop("GET", "GETFILESTATUS", f"{root}/offsets/11", 404),
        *_listener(root, 10),  # the listener's, for batch 10: lands in batch 11
        _hadoop("GET", "GETSERVERDEFAULTS", "/", 200),
        _hadoop("GET", "GETFILESTATUS", f"{root}/state/0/11", 200),  # partition 11: not a batch
        _hadoop("GET", "GETFILESTATUS", f"{root}/offsets/10", 200),
        _hadoop("PUT", "CREATE", state_tmp, 307),
        _hadoop("PUT", "CREATE", state_tmp, 201, "&data=true", data=True),
        _hadoop(
            "PUT",
            "RENAME",
            state_tmp,
            200,
            "&destination=" + urllib.parse.quote(f"{root}/state/0/11/12.delta", safe=""),
        ),
        *_commit(root, 11, U0.replace("c", "d")),
        *_listener(root, 11),
        _line("POST", "-", "/oauth2/token", 200, ""),
        "2026-11-29 00:47:42,783 sos.gateway INFO issued a append token for key k (3600 s)",
    ]
    return "\n".join(lines)


def test_the_log_parser_reads_every_request_line():
    reqs = load.parse_log(_log())
    assert len(reqs) == 18
    assert reqs[2].op == "RENAME" and reqs[2].destination == "/q/chk/commits/10"
    assert reqs[1].data and not reqs[0].data and reqs[1].status == 201
    assert reqs[5].path == load.MARKER_PATH and reqs[5].fs_path == ""
    assert reqs[3].fs_path == "/q/chk/offsets/11"
    assert load.committed_batches(reqs, "/q/chk") == [10, 11]


def test_a_batch_is_hadoops_requests_between_two_commits_then_its_own_marker():
    batch = load.batch_of(load.parse_log(_log()), "/q/chk", 11)
    ops = [(r.op, r.fs_path.rsplit("/", 1)[-1] if r.fs_path else r.path) for r in batch]
    assert ops[0] == ("GETFILESTATUS", "11")  # offsets/11: the first after commits/10
    assert ("GETFILESTATUS", "10") not in ops[:1]
    # the listener's requests for batch 10 are left out; those for 11 end the batch
    assert ops[-2:] == [("GETFILESTATUS", "11"), ("-", load.MARKER_PATH)]
    assert batch[-2].fs_path == "/q/chk/commits/11"
    assert sum(1 for r in batch if r.path == load.MARKER_PATH) == 1
    assert len(batch) == 12
    with pytest.raises(ValueError, match="no whole batch 12"):
        load.batch_of(load.parse_log(_log()), "/q/chk", 12)


def test_templates_name_the_root_batch_numbers_and_uuids_but_not_partitions():
    t = load.Templater("/q/chk", 11)
    assert t.path("/q/chk/offsets/11") == "{root}/offsets/{batch}"
    assert t.path("/q/chk/offsets/10") == "{root}/offsets/{batch-1}"
    assert t.path("/q/chk/state/0/11") == "{root}/state/0/11"  # a partition directory
    assert (
        t.path(f"/q/chk/state/0/11/.12.delta.{U1}.TID45.tmp") == "{root}/state/0/11/.{batch+1}.delta.{uuid0}.TID45.tmp"
    )
    assert t.path(f"/q/chk/commits/.11.{U0}.tmp") == "{root}/commits/.{batch}.{uuid1}.tmp"
    assert t.path(f"/q/chk/commits/.11.{U0.upper()}.tmp") == "{root}/commits/.{batch}.{uuid1}.tmp"
    assert t.path("/q/chk/sources/0/000123-x.sst") == "{root}/sources/0/000123-x.sst"  # not a batch number
    assert t.path("/q/chk/odd{name}/11") == "{root}/odd{{name}}/{batch}"
    assert t.path("/elsewhere/11") == "/elsewhere/11"
    assert t.path("/q/chk") == "{root}"
    values = load.batch_values("/load/x/q3", 40, 2, "seed")
    assert load.expand("{root}/odd{{name}}/.{batch+1}.delta.{uuid1}", values) == (
        f"/load/x/q3/odd{{name}}/.41.delta.{values['uuid1']}"
    )
    # every batch and every query has its own temporary names
    assert load.batch_values("/r", 40, 1, "a")["uuid0"] != load.batch_values("/r", 41, 1, "a")["uuid0"]
    assert load.batch_values("/r", 40, 1, "a")["uuid0"] != load.batch_values("/r", 40, 1, "b")["uuid0"]


def test_the_pattern_holds_the_bodies_and_what_must_exist_before_a_batch():
    root = "/q/chk"
    batch = load.batch_of(load.parse_log(_log()), root, 11)
    stat = {
        f"{root}/state/0/11/12.delta": {"type": "FILE", "length": 321},
        f"{root}/commits/11": {"type": "FILE", "length": 29},
        f"{root}/offsets/10": {"type": "FILE", "length": 500},
        f"{root}/state/0/11": {"type": "DIRECTORY"},
    }
    pattern = load.make_pattern(batch, root, 11, stat, {"query": "test"})
    assert pattern["about"]["batch"] == 11 and pattern["about"]["requests"] == 12
    data = [r for r in pattern["requests"] if r["data"]]
    assert [r["body"] for r in data] == [321, 29]  # the size each file has where it was renamed to
    rename = next(r for r in pattern["requests"] if r["op"] == "RENAME")
    assert dict(rename["params"])["destination"] == "{root}/state/0/11/{batch+1}.delta"
    setup = {e["path"]: e for e in pattern["setup"]}
    assert setup["{root}/offsets/{batch-1}"] == {"path": "{root}/offsets/{batch-1}", "type": "FILE", "length": 500}
    assert setup["{root}/state/0/11"]["type"] == "DIRECTORY"
    assert "{root}/commits/{batch}" not in setup  # the batch makes it
    assert "/q" not in setup  # MKDIRS of the root's children make it
    paths = [e["path"] for e in pattern["setup"]]
    assert paths.index("{root}/state") < paths.index("{root}/state/0") < paths.index("{root}/state/0/11")
    assert load.op_counts(pattern)["marker"] == 1
    text = load.dump_pattern(pattern)
    assert text.count("\n") > len(pattern["requests"])  # one request a line
    import json

    assert json.loads(text) == pattern


def test_the_checked_in_small_query_is_the_issues_54_requests():
    pattern = load.load_pattern(load.DEFAULT_PATTERN)
    counts = load.op_counts(pattern)
    assert len(pattern["requests"]) == 54
    assert counts["GETFILESTATUS"] == 20 and counts["GETFILELINKSTATUS"] == 10
    assert counts["GETSERVERDEFAULTS"] == 6 and counts["RENAME"] == 5 and counts["marker"] == 1
    assert counts["CREATE"] == counts["CREATE data"] == 5
    assert counts["OPEN"] == counts["OPEN data"] == 1


def test_the_checked_in_query_at_200_partitions_writes_a_changelog_per_partition():
    pattern = load.load_pattern(os.path.join(ROOT, "bench", "data", "rocksdb_200.json"))
    counts = load.op_counts(pattern)
    assert len(pattern["requests"]) > 1800 and counts["marker"] == 1
    changelogs = {
        r["path"].split("/")[3]
        for r in pattern["requests"]
        if r["data"] and r["path"].startswith("{root}/state/0/") and ".changelog." in r["path"]
    }
    assert changelogs == {str(p) for p in range(200)}  # partition directories kept as they are
    assert sum(1 for e in pattern["setup"] if e["path"].startswith("{root}/state/0/")) == 200


def test_the_report_divides_cpu_by_the_requests_of_the_window():
    a, b = load.QueryStats(), load.QueryStats()
    a.batches = [(0.5, 0.9), (1.0, 1.2), (2.0, 2.4), (3.0, 3.1), (9.9, 10.5)]
    b.batches = [(1.5, 1.6), (2.5, 2.9)]
    b.mismatches["RENAME"] = 2
    b.error = "HttpError: boom"
    row = load.summarize([a, b], (1.0, 10.0), {"gateway": (5.0, 5.9), "server": (1.0, 1.09)}, (100, 550), 1.0)
    assert row["queries"] == 2 and row["offered_batches_per_s"] == 2.0
    assert row["batches"] == 5  # ended inside the window: 1.2, 2.4, 3.1, 1.6, 2.9
    assert row["achieved_batches_per_s"] == pytest.approx(5 / 9)
    assert row["requests"] == 450 and row["requests_per_s"] == pytest.approx(50)
    assert row["gateway_cpu_us_per_request"] == pytest.approx(2000)
    assert row["server_cpu_us_per_request"] == pytest.approx(200)
    assert row["gateway_cpu_share"] == pytest.approx(0.1)
    assert row["batch_p50_ms"] == pytest.approx(200)  # of the batches wholly inside: 200, 400, 100, 100, 400
    assert row["mismatches"] == {"RENAME": 2} and row["errors"] == ["HttpError: boom"]
    row["mode"] = "sync"
    text = "\n".join(load.report_lines([row]))
    assert "2000" in text and "HttpError: boom" in text


def test_cpu_seconds_reads_proc():
    before = load.cpu_seconds(os.getpid())
    sum(i * i for i in range(300_000))
    assert load.cpu_seconds(os.getpid()) >= before > 0


def test_requests_look_like_hadoops():
    assert load.chunked(b"x" * 5, chunk=2) == b"2\r\nxx\r\n2\r\nxx\r\n1\r\nx\r\n0\r\n\r\n"
    head = load._head("PUT", "/webhdfs/v1/a?op=CREATE", "h:1", "T", 10).decode()
    assert "Transfer-Encoding: chunked" in head and "Authorization: Bearer T" in head
    assert "Content-Length: 0" in load._head("PUT", "/x", "h:1", "T", None).decode()
    assert "Content-Length" not in load._head("GET", "/x", "h:1", "T", None).decode()
    assert load.source_address(0) == "127.0.0.2" and load.source_address(300) == "127.0.1.46"


def test_help_names_both_steps():
    assert "capture" in load.parser().format_help()
    with pytest.raises(SystemExit):
        load.main(["--queries", "0"])


@pytest.mark.slow  # ~10 s: a real server and gateway
def test_the_small_query_replays_as_captured_on_a_real_gateway(server, tmp_path):
    """The checked-in pattern still fits the gateway: two imitated queries, each from its own
    address with its own token, run batches for a few seconds; every reply has the status the
    capture got, and the gateway's CPU per request is measured."""
    from spark_plugin.gateway.process import GatewayProcess

    key = server.keygen(load.NAMESPACE, "append")
    gw = GatewayProcess(
        load.NAMESPACE, str(tmp_path / "cache"), server.address, key, log_path=str(tmp_path / "gw.log")
    ).start()
    try:
        pattern = load.load_pattern(load.DEFAULT_PATTERN)
        row = load.replay(
            pattern,
            str(gw.url),
            {"gateway": int(gw.pid), "server": int(server.pid)},
            key,
            2,
            label="test",
            seconds=2.5,
            warmup=0.5,
            interval=0.5,
        )
    finally:
        gw.stop()
    assert row["errors"] == [] and row["mismatches"] == {}, row
    assert row["requests"] >= 54 and row["batches"] >= 1, row
    assert row["gateway_cpu_us_per_request"] > 0


def _json_lines(text: str) -> str:
    """The same log as ``sos gateway --debug`` writes it now: JSON lines (sos_wire.logs)."""
    fmt = JsonFormatter()
    lines = []
    for line in text.splitlines():
        _day, _time, _logger, level, msg = line.split(" ", 4)
        name = "spark_plugin.gateway.http.server" if level == "DEBUG" else "spark_plugin.gateway.http.auth"
        lines.append(fmt.format(logging.LogRecord(name, getattr(logging, level), "", 0, msg, (), None)))
    return "\n".join(["sos gateway: ready on http://127.0.0.1:9870 (namespace q, sync)", *lines])


def test_the_log_parser_reads_the_json_log_as_the_text_one():
    text = _json_lines(_log())
    assert text.splitlines()[1].startswith('{"ts": ')

    def strip(reqs):
        return [dataclasses.replace(r, when="") for r in reqs]

    assert strip(load.parse_log(text)) == strip(load.parse_log(_log()))
    assert len(load.parse_log(text)) == 18
