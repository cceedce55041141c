"""The fixture the client's test modules share."""

from __future__ import annotations

import itertools

import pytest

_n = itertools.count()


@pytest.fixture
def ns(server):
    """A fresh namespace per test on the module's server, with an append key and a read key."""
    name = f"t{next(_n)}"
    return name, server.keygen(name, "append"), server.keygen(name, "read")
