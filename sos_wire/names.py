"""Object-name and namespace rules (protocol.md, "Names").

Names are relative POSIX-like paths inside a namespace:

* 1..1024 bytes of UTF-8, segments separated by ``/``;
* no leading or trailing ``/``, no empty segment, no ``.`` or ``..`` segment;
* each segment 1..255 bytes of ``[A-Za-z0-9._=+,@~-]`` (so no NUL, no space,
  no control or non-ASCII character).

Namespaces match ``[a-z0-9][a-z0-9_-]{0,62}``.
"""

from __future__ import annotations

import re

__all__ = ["MAX_NAME_BYTES", "MAX_SEGMENT_BYTES", "BadName", "validate_name", "validate_namespace"]

MAX_NAME_BYTES = 1024
MAX_SEGMENT_BYTES = 255

_SEGMENT = re.compile(r"[A-Za-z0-9._=+,@~-]+")
_NAMESPACE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


class BadName(ValueError):
    """A name or namespace that breaks the rules; the message says which rule."""


def validate_name(name: str) -> str:
    """Return *name* unchanged if it is a valid object name, else raise BadName."""
    if not isinstance(name, str):
        raise BadName(f"object name must be str, not {type(name).__name__}")
    if not name:
        raise BadName("object name is empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadName(f"object name {name!r} is not valid UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise BadName(f"object name is {size} bytes, the limit is {MAX_NAME_BYTES}")
    if name.startswith("/"):
        raise BadName(f"object name {name!r} must not start with '/'")
    for seg in name.split("/"):
        if not seg:
            raise BadName(f"object name {name!r} has an empty segment")
        if seg in (".", ".."):
            raise BadName(f"object name {name!r} has a {seg!r} segment")
        if len(seg) > MAX_SEGMENT_BYTES:
            raise BadName(f"object name {name!r} has a segment of {len(seg)} bytes, the limit is {MAX_SEGMENT_BYTES}")
        if not _SEGMENT.fullmatch(seg):
            bad = next(c for c in seg if not _SEGMENT.fullmatch(c))
            raise BadName(f"object name {name!r} contains the forbidden character {bad!r}")
    return name


def validate_namespace(namespace: str) -> str:
    """Return *namespace* unchanged if it matches ``[a-z0-9][a-z0-9_-]{0,62}``, else raise BadName."""
    if not isinstance(namespace, str):
        raise BadName(f"namespace must be str, not {type(namespace).__name__}")
    if not _NAMESPACE.fullmatch(namespace):
        raise BadName(f"namespace {namespace!r} is invalid: it must match [a-z0-9][a-z0-9_-]{{0,62}}")
    return namespace
