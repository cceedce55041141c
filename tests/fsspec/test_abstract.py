"""fsspec's own abstract test suite (copy, get, put, pipe, open) against
SOSFileSystem backed by a real sos-server process on 127.0.0.1."""

from __future__ import annotations

import itertools

import fsspec.tests.abstract as abstract
import pytest

from spark_plugin.fsspec import filesystem as sosfs
from spark_plugin.fsspec.filesystem import SOSFileSystem

NAMESPACE = "fsspec-abstract"


@pytest.fixture(scope="module")
def abstract_server(server):
    yield server
    sosfs.close_all()


@pytest.fixture(scope="module")
def abstract_fs(abstract_server, tmp_path_factory):
    key = abstract_server.keygen(NAMESPACE, "append")
    cache = str(tmp_path_factory.mktemp("sos-abstract-cache"))
    fs = SOSFileSystem(server=abstract_server.address, key=key, cache_dir=cache)
    yield fs
    sosfs.close_all()


_counter = itertools.count()


class SOSFixtures(abstract.AbstractFixtures):
    @pytest.fixture
    def fs(self, abstract_fs):
        return abstract_fs

    @pytest.fixture
    def fs_join(self):
        return lambda *parts: "/".join(parts)

    @pytest.fixture
    def fs_path(self, abstract_fs):
        # a fresh directory per test inside the shared namespace
        return f"{NAMESPACE}/t{next(_counter)}"

    @pytest.fixture
    def supports_empty_directories(self):
        return True


class TestSOSCopy(abstract.AbstractCopyTests, SOSFixtures):
    pass


class TestSOSGet(abstract.AbstractGetTests, SOSFixtures):
    pass


class TestSOSPut(abstract.AbstractPutTests, SOSFixtures):
    pass


class TestSOSPipe(abstract.AbstractPipeTests, SOSFixtures):
    pass


class TestSOSOpen(abstract.AbstractOpenTests, SOSFixtures):
    pass
