"""Structured logs: one JSON object per line on stderr (the one setup of every command:
sos_wire.logs)."""

from __future__ import annotations

from sos_wire.logs import JsonFormatter, setup_logging

__all__ = ["JsonFormatter", "setup_logging"]
