"""sos_client: blocking and trio clients of the SOS protocol, and the `sos` command.

``Client`` (``blocking``) and ``aio.open_client`` (trio) over ``core`` (the protocol steps
both drivers share) and ``retry`` (tenacity policies); ``process`` and ``serving`` (child
processes, readiness lines); ``cli`` (the ``sos`` command). Exceptions in
``sos_client.errors``, re-exported here (their one list is ``sos_client.errors.__all__``).
``Client`` and the others are imported when first used (sos_wire.lazy): ``sos --help`` needs
no connection. May import: sos_wire (and sos_tier, below it); never sos_server, sos_journal
or a face (their subcommands join ``sos`` through entry points, ``cli.plugged_commands``).
"""

from typing import TYPE_CHECKING

from sos_client import errors
from sos_client.errors import *  # noqa: F403 - the exceptions and their classification, listed once in errors.__all__
from sos_wire.lazy import lazy_exports

if TYPE_CHECKING:
    from sos_client.blocking import Client
    from sos_client.core import resolve_key, resolve_server
    from sos_wire import Key, ListEntry

__all__ = ["Client", "Key", "ListEntry", "resolve_key", "resolve_server"]
__all__ += errors.__all__

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "sos_client.blocking": ("Client",),
        "sos_client.core": ("resolve_key", "resolve_server"),
        "sos_wire": ("Key", "ListEntry"),
    },
)
