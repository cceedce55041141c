"""The entry points pyproject.toml declares name what exists: the console scripts, fsspec's
``sos`` protocol and the ``sos.commands`` that plug subcommands into ``sos`` (each a function
``add_parser(subparsers)``). Read from pyproject.toml itself, so a rename is caught before any
reinstall; the installed metadata is compared with it where it must be fresh (CI, whose
scripts/setup reinstalls when pyproject.toml changes)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared() -> dict[str, dict[str, str]]:
    groups = {"console_scripts": PROJECT["scripts"]}
    groups |= PROJECT["entry-points"]
    return groups


def _load(value: str) -> object:
    module, _, attr = value.partition(":")
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("group,name,value", [(g, n, v) for g, eps in _declared().items() for n, v in eps.items()])
def test_every_declared_entry_point_names_an_importable_object(group, name, value):
    obj = _load(value)
    assert callable(obj), (group, name, value)
    if group == "sos.commands":  # add_parser(subparsers): it adds its subcommands there
        assert len(inspect.signature(obj).parameters) == 1, value
        sub = argparse.ArgumentParser(prog="sos").add_subparsers()
        obj(sub)
        assert sub.choices, f"{value} added no subcommand"


def test_the_sos_commands_cover_restore_verify_mount_and_gateway():
    sub = argparse.ArgumentParser(prog="sos").add_subparsers()
    for value in PROJECT["entry-points"]["sos.commands"].values():
        _load(value)(sub)
    assert {"restore", "verify", "mount", "gateway"} <= set(sub.choices)


def test_the_installed_metadata_is_the_declared_one():
    installed = {g: {ep.name: ep.value for ep in entry_points(group=g)} for g in _declared()}
    mine = {g: {n: v for n, v in eps.items()} for g, eps in _declared().items()}
    # other distributions may add to a group (fsspec's own protocols): compare ours only
    found = {g: {n: installed[g].get(n) for n in eps} for g, eps in mine.items()}
    if found != mine and not os.environ.get("SOS_TEST_NO_SKIP"):
        pytest.skip("the installed sos metadata predates pyproject.toml: scripts/setup reinstalls it")
    assert found == mine
