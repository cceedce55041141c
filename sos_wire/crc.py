"""CRC32C (Castagnoli), the only checksum of the protocol."""

from __future__ import annotations

import crc32c as _crc32c

__all__ = ["crc32c"]


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of *data* (any bytes-like object), continuing from *value*.

    ``crc32c(b + c) == crc32c(c, crc32c(b))``; ``crc32c(b"123456789") == 0xE3069283``.
    """
    return _crc32c.crc32c(data, value)
