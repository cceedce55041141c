"""The commands' JSON log lines (sos_wire.logs) as the text lines the older tools read:
``YYYY-MM-DD HH:MM:SS,mmm LOGGER LEVEL message``. A line that is not JSON stays as it is, so a
log of before the JSON logs (or a ready line) reads the same."""

from __future__ import annotations

import json


def as_text(text: str) -> str:
    """``text`` with each JSON log line written as a text one."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                when = str(rec.get("ts", "")).rstrip("Z").replace("T", " ").replace(".", ",")
                line = f"{when} {rec.get('logger', '')} {str(rec.get('level', '')).upper()} {rec.get('msg', '')}"
        out.append(line)
    return "\n".join(out)
