"""The benchmark scripts (bench/): they run and judge like for like. Benchmarks are not
tests: nothing here asserts a speed, only that the scripts work and compare the right
figures."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import append  # noqa: E402 - bench/ is found from the checkout

MIB = 1 << 20


def _result(name: str, size: int, writers: int, ops: int) -> append.Result:
    return append.Result(name, size, writers, ops, 1.0, [0.001] * ops)  # ops over one second


def test_append_verdicts_compare_n_sos_writers_with_n_raw_threads():
    # issue 12 point 10: 8 SOS writers at 124% of ONE raw writer printed "MET" (here 128%), while the
    # same disk took 8 raw threads at 6x that rate
    results = [
        _result("raw write+fdatasync", MIB, 1, 100),
        _result("raw write+fdatasync", MIB, 8, 800),
        _result("sos-server", MIB, 1, 90),
        _result("sos-server", MIB, 8, 128),
    ]
    lines = [line for line in append.verdicts(results) if line.startswith("target 1 MiB")]
    assert len(lines) == 2, lines
    one, eight = lines
    assert "1 writer(s) vs 1 raw thread(s)" in one and one.endswith("MET"), one
    assert "8 writer(s) vs 8 raw thread(s)" in eight and eight.endswith("MISSED"), eight
    assert "= 16% of raw" in eight, eight  # 128 / 800, not 128 / 100


def test_append_verdicts_skip_a_writer_count_without_its_raw_figure():
    results = [_result("raw write+fdatasync", MIB, 1, 100), _result("sos-server", MIB, 8, 124)]
    assert not [line for line in append.verdicts(results) if line.startswith("target 1 MiB")]
