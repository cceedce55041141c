"""argparse types shared by ``sos`` and ``sos-server``: integers with bounds, sizes and
durations. Sizes and durations are humanfriendly's parsers (binary units: ``64M`` = ``64MiB``
= 64 x 2**20; ``90``, ``90s``, ``15m``, ``2h``, ``7d``, ``1w``, ``250ms``).

Pure functions, no I/O: they live here because sos_wire is the one package both commands
depend on. A bad value raises ``argparse.ArgumentTypeError``: argparse prints it and exits 2.
humanfriendly is imported when a size or a duration is parsed (it costs ~8 ms of CPU, at the
start of every command that would not parse one).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["duration", "integer", "size"]


def _bounded(value: int, text: str, minimum: int, maximum: int | None) -> int:
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {text!r}")
    if maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum}, not {text!r}")
    return value


def integer(minimum: int = 0, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a decimal integer in ``minimum..maximum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        return _bounded(value, text, minimum, maximum)

    parse.__name__ = "integer"  # argparse names the type in its error message
    return parse


def size(minimum: int = 0) -> Callable[[str], int]:
    """An argparse type: a byte count such as ``4096``, ``64K``, ``512MiB``, ``10G``."""

    def parse(text: str) -> int:
        from humanfriendly import InvalidSize, parse_size  # noqa: PLC0415 - see the module's docstring

        try:
            value = parse_size(text, binary=True)
        except InvalidSize:
            raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1000000, 64K, 512M, 10G") from None
        return _bounded(int(value), text, minimum, None)

    parse.__name__ = "size"
    return parse


def duration(text: str) -> float:
    """An argparse type: seconds, from ``90``, ``90s``, ``15m``, ``2h``, ``7d``, ``250ms``."""
    from humanfriendly import InvalidTimespan, parse_timespan  # noqa: PLC0415 - see the module's docstring

    try:
        value = float(parse_timespan(text))
    except InvalidTimespan:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 30s, 15m, 2h, 7d") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a duration is not negative: {text!r}")
    return value
