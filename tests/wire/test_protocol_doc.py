"""protocol.md cannot drift from the codec: every hex example in it decodes to the
event written above it, and encodes back to exactly those bytes."""

from __future__ import annotations

import re
from pathlib import Path

import sos_wire
from sos_wire import NEED_DATA, Connection, Request, Role, encode_event, proof
from sos_wire.connection import OP_OF
from sos_wire.frames import Op
from tests.support import client_expecting

DOC = Path(__file__).resolve().parents[2] / "protocol.md"
EXAMPLE = re.compile(r"Example: `(?P<expr>[^`]+)`\s*\n\s*```hex\n(?P<hex>.*?)```", re.S)


def part1() -> str:
    """The wire protocol; Part 2 (the journal format) has its own test in test_journal_records."""
    return DOC.read_text(encoding="utf-8").split("\n# Part 2: the journal format\n", 1)[0]


def examples():
    text = part1()
    return [(m.group("expr"), m.group("hex")) for m in EXAMPLE.finditer(text)]


def hex_bytes(block: str) -> bytes:
    return bytes.fromhex("".join(line.split("#", 1)[0] for line in block.splitlines()).replace(" ", ""))


def test_every_frame_type_has_an_example():
    found = {OP_OF[type(eval(expr, vars(sos_wire)))] for expr, _ in examples()}
    assert found == set(Op)
    assert part1().count("```hex") == len(examples())  # none missed by the regex


def test_every_example_decodes_to_its_event_and_back():
    for expr, block in examples():
        event = eval(expr, vars(sos_wire))
        data = hex_bytes(block)
        assert encode_event(event) == data, expr
        if isinstance(event, Request):
            conn = Connection(Role.SERVER)
        else:
            conn = client_expecting(OP_OF[type(event)], event.request_id)
        conn.receive_data(data)
        assert conn.next_event() == event, expr
        assert conn.next_event() is NEED_DATA


def test_handshake_example_proof():
    text = DOC.read_text(encoding="utf-8")
    want = proof(b"\x11" * 32, bytes(range(32)), "ns1", bytes.fromhex("0123456789abcdef")).hex()
    assert f"proof = `{want}`" in text
    assert "0123456789abcdef." + "11" * 32 in text


def test_documented_numbers_match_the_code():
    text = DOC.read_text(encoding="utf-8")
    for code in sos_wire.ErrorCode:
        assert f"| {code.value} | {code.name} |" in text
    for op in Op:
        if op < 0x80:
            reply = Op(op | 0x80)
            assert f"| {op.name} | 0x{op.value:02X} | {reply.name}" in text
            assert f"| 0x{reply.value:02X} |" in text
    assert "| ERROR | 0xFF |" in text  # the row of the opcode table
    assert f"{sos_wire.DEFAULT_MAX_BODY:,}" in text
    assert "# Part 2: the journal format" in text
