"""Module paths from before issue 27's packages still import (the README's and docs' names of
that time): each old path gives the very module object of its new home, and the old package's
names are the same objects as the new package's."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from sos_client.journal import MOVED
from spark_plugin.gateway import MOVED as GATEWAY_MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_journal_module_path_is_its_new_module(old):
    module = importlib.import_module(f"sos_client.journal.{old}")
    assert module is importlib.import_module(MOVED[old])
    assert module.__spec__.name == MOVED[old]  # its own spec, not the old name's


@pytest.mark.parametrize("old", sorted(GATEWAY_MOVED))
def test_an_old_gateway_module_path_is_its_new_module(old):
    module = importlib.import_module(f"spark_plugin.gateway.{old}")
    assert module is importlib.import_module(GATEWAY_MOVED[old])
    assert module.__spec__.name == GATEWAY_MOVED[old]


def test_the_old_package_names_are_the_journals_and_restore_stays_the_function():
    code = (
        "from sos_client.journal.restore import rebuild_cache\n"  # the submodule first: then the names
        "from sos_client.journal import JournaledTree, JournalWriter, restore, replay, verify\n"
        "from sos_client.journal.bucket import BucketSource\n"
        "import sos_journal, sos_client.journal as old\n"
        "assert restore is sos_journal.restore and replay is sos_journal.replay and verify is sos_journal.verify\n"
        "assert old.restore is restore and callable(old.restore)\n"
        "assert JournaledTree is sos_journal.JournaledTree and JournalWriter is sos_journal.JournalWriter\n"
        "assert BucketSource.__module__ == 'sos_journal.read.bucket'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_name_that_never_existed_is_an_attribute_error():
    import sos_client.journal as old

    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("sos_client.journal.no_such_module")
