"""One set of argparse types (sos_wire.argtypes: integers, humanfriendly sizes and durations)
behind every command: each command refuses a bad value with exit status 2 and says which
option, before doing anything."""

from __future__ import annotations

import argparse

import pytest

from sos_client.cli import build_parser as sos_parser
from sos_server.cli import build_parser as server_parser
from sos_wire import argtypes


@pytest.mark.parametrize(
    "text,value",
    [
        ("4096", 4096),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("512MiB", 512 << 20),
        ("512M", 512 << 20),
        ("10G", 10 << 30),
        ("1.5k", 1536),
        ("2TiB", 2 << 40),
    ],
)
def test_sizes_are_binary(text, value):
    assert argtypes.size(0)(text) == value


@pytest.mark.parametrize(
    "text,value",
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("7d", 7 * 86400.0),
        ("1w", 7 * 86400.0),
        ("250ms", 0.25),
    ],
)
def test_durations(text, value):
    assert argtypes.duration(text) == value


@pytest.mark.parametrize(
    "parse,text,words",
    [
        (argtypes.size(0), "lots", "bad size"),
        (argtypes.size(1), "0", "at least 1"),
        (argtypes.duration, "soon", "bad duration"),
        (argtypes.integer(0), "x1", "not an integer"),
        (argtypes.integer(1), "0", "at least 1"),
        (argtypes.integer(0, 9), "10", "at most 9"),
    ],
)
def test_bad_values_are_argparse_errors(parse, text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        parse(text)


@pytest.mark.parametrize(
    "parser,argv,option",
    [
        (server_parser, ["serve", "--data", "/nonexistent", "--wal-size", "lots"], "--wal-size"),
        (server_parser, ["serve", "--data", "/nonexistent", "--idle-timeout", "soon"], "--idle-timeout"),
        (server_parser, ["serve", "--data", "/nonexistent", "--max-connections", "0"], "--max-connections"),
        (server_parser, ["reset-fence", "--data", "/nonexistent", "ns", "--epoch", "-1"], "--epoch"),
        (sos_parser, ["mount", "ns", "/nonexistent", "--generation-bytes", "0"], "--generation-bytes"),
        (sos_parser, ["mount", "ns", "/nonexistent", "--max-lag", "much"], "--max-lag"),
        (sos_parser, ["gateway", "ns", "--threads", "0"], "--threads"),
        (sos_parser, ["gateway", "ns", "--token-ttl", "an hour"], "--token-ttl"),
        (sos_parser, ["restore", "ns", "/nonexistent", "--generation", "-3"], "--generation"),
    ],
)
def test_every_command_refuses_a_bad_value_with_exit_2(parser, argv, option, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    assert option in capsys.readouterr().err
