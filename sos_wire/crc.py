"""CRC32C (Castagnoli), the only checksum of the protocol.

The function is the compiled one of the ``crc32c`` package. That package's ``__init__`` asks
importlib.metadata for its own version, which imports email, zipfile and csv and reads the
installed distributions: about 25 ms of CPU at the start of every process that checksums (every
``sos`` command, server, gateway and mount). So this module loads the compiled module
``crc32c._crc32c`` from the package's folder without running that ``__init__`` (the same file,
the same function); where the package is not a plain folder (a zip, a frozen build), it imports
the package as usual.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib.machinery import EXTENSION_SUFFIXES, ExtensionFileLoader, ModuleSpec, PathFinder
from types import ModuleType

__all__ = ["crc32c", "crc32c_compiled"]

_EXTENSION = "crc32c._crc32c"


def _compiled_module() -> ModuleType:
    """``crc32c._crc32c``: the one already imported, else loaded from the package's folder
    without the package's ``__init__``, else (no such file) imported with it."""
    loaded = sys.modules.get(_EXTENSION)
    if loaded is not None:
        return loaded
    package = PathFinder.find_spec("crc32c")  # finds the package; runs none of it
    folders = list(package.submodule_search_locations or []) if package is not None else []
    for folder in folders:
        for suffix in EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_crc32c" + suffix)
            if os.path.isfile(path):
                loader = ExtensionFileLoader(_EXTENSION, path)
                module = loader.create_module(ModuleSpec(_EXTENSION, loader, origin=path))
                loader.exec_module(module)
                return module
    import crc32c._crc32c as imported  # noqa: PLC0415 - not a plain folder: the usual import, __init__ and all

    return imported


#: the compiled function itself, ``(data, value=0) -> int``: for a caller that calls it once per
#: few hundred bytes (the gateway's HDFS block checksums), without :func:`crc32c`'s Python frame
crc32c_compiled: Callable[[bytes | bytearray | memoryview, int], int] = _compiled_module().crc32c


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of *data* (any bytes-like object), continuing from *value*.

    ``crc32c(b + c) == crc32c(c, crc32c(b))``; ``crc32c(b"123456789") == 0xE3069283``.
    """
    return crc32c_compiled(data, value)
