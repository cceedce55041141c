"""The CI plumbing: README's commands, .ci/run, scripts/setup idempotence."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_opens_with_title_sentence_and_quick_start():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0].startswith("# ")
    assert lines[1] == "" and lines[2] and not lines[2].startswith("#")
    start = lines.index("## Quick start")
    fence = lines.index("```sh", start)
    assert lines[fence + 1] == "./scripts/demo"
    assert lines[fence + 2] == "./scripts/test"
    assert lines[fence + 3] == "```"


def test_scripts_use_the_project_venv_not_the_system_interpreter():
    setup = (ROOT / "scripts" / "setup").read_text()
    assert "PIP_BREAK_SYSTEM_PACKAGES" not in setup
    assert "python3 -m venv" in setup and '"$PY" -m pip install' in setup
    for name in ("test", "demo", "soak"):
        text = (ROOT / "scripts" / name).read_text()
        assert ".venv/bin/python" in text, name


def test_ci_run_calls_the_readme_test_command():
    text = (ROOT / ".ci" / "run").read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert "exec ./scripts/test" in text
    assert "export SOS_TEST_NO_SKIP=1" in text  # CI's machine has FUSE and Spark: no skips
    for opt in ("--cov=sos_wire", "--cov=sos_server", "--cov=sos_client", "--cov=spark_plugin", "--cov-branch"):
        assert opt in text, opt


#: one process, and scripts/test's parallel run (pytest-xdist workers, their coverage combined)
WORKERS = pytest.mark.parametrize("workers", [["-n", "0"], ["-n", "2", "--dist", "loadgroup"]], ids=["serial", "xdist"])


@WORKERS
def test_coverage_prints_one_total_line_and_leaves_child_processes_alone(tmp_path, workers):
    """.ci/run's coverage options: a single 'branch coverage of ...: N %' line before pytest's
    closing line; a child Python process gets no coverage hook (no COVERAGE_PROCESS_* in its
    environment, so it runs as it would without coverage)."""
    (tmp_path / "test_c.py").write_text(
        "import os, subprocess, sys\n"
        "from sos_wire.crc import crc32c\n"
        "def test_crc():\n    assert crc32c(b'123456789') == 0xE3069283\n"
        "def test_child_unmeasured():\n"
        "    out = subprocess.run([sys.executable, '-c', 'import os; print(sorted(k for k in os.environ'\n"
        '                          \' if k.startswith(("COV_", "COVERAGE_"))))\'],\n'
        "                         capture_output=True, text=True, check=True).stdout\n"
        "    assert out.strip() == '[]', out\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "--cov=sos_wire",
            "--cov-branch",
            "--cov-report=",
            *workers,
            str(tmp_path / "test_c.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("2 passed"), lines
    assert lines[-2].startswith("branch coverage of sos_wire: ") and " % " in lines[-2], lines


@WORKERS
def test_no_skip_mode_turns_skips_into_failures(tmp_path, workers):
    (tmp_path / "test_s.py").write_text(
        "import pytest\n"
        "def test_skips():\n    pytest.skip('no /dev/fuse')\n"
        "@pytest.mark.xfail(strict=True)\ndef test_xfails():\n    assert 0\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "conftest",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tmp_path),
        *workers,
        str(tmp_path / "test_s.py"),
    ]
    strict = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(env, SOS_TEST_NO_SKIP="1")
    )
    assert strict.returncode == 1 and "1 failed, 1 xfailed" in strict.stdout, strict.stdout
    assert "forbids skips: Skipped: no /dev/fuse" in strict.stdout
    env.pop("SOS_TEST_NO_SKIP", None)
    lax = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert lax.returncode == 0 and "1 skipped, 1 xfailed" in lax.stdout, lax.stdout


def test_scripts_are_executable_bash_with_strict_mode():
    for name in ("setup", "test", "demo"):
        path = ROOT / "scripts" / name
        assert os.access(path, os.X_OK), path
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), path
        assert "set -euo pipefail" in text, path
        subprocess.run(["bash", "-n", str(path)], check=True)
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


@pytest.mark.slow  # runs scripts/setup
def test_setup_is_idempotent_and_leaves_the_tools_usable():
    # scripts/test already ran it once before pytest; a second run must succeed with
    # nothing to do, and what it installed must be importable / on PATH.
    proc = subprocess.run([str(ROOT / "scripts" / "setup")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "setup: ok" in proc.stderr
    java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=120)
    assert java.returncode == 0
    check = subprocess.run(
        [sys.executable, "-c", "import pyspark, pyfuse3, fsspec, trio"], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.slow  # runs scripts/setup
def test_test_script_passes_arguments_and_exit_code_through(tmp_path):
    # a failing test file given on the command line: scripts/test must exit with pytest's code
    bad = tmp_path / "test_fails.py"
    bad.write_text("def test_no():\n    assert 1 == 2\n")
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        # -n 0 (one process, as the script's comment offers): its four workers, each importing
        # pytest's plugins for one test, took this test to 99 s on CI's loaded machine
        [str(ROOT / "scripts" / "test"), "-n", "0", str(bad), "--rootdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed" in proc.stdout


@pytest.mark.slow  # runs scripts/setup
def test_demo_script_runs_the_demo_module():
    proc = subprocess.run([str(ROOT / "scripts" / "demo"), "--help"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    for opt in ("--records", "--batches", "--keep", "--state-store"):
        assert opt in proc.stdout
    bad = subprocess.run(
        [str(ROOT / "scripts" / "demo"), "--state-store", "nope"], capture_output=True, text=True, timeout=900
    )
    assert bad.returncode == 2  # usage error, before anything starts


def test_demo_is_the_cluster_demo_and_the_mount_demo_is_behind_a_flag():
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def demo(*args):
        return subprocess.run(
            [sys.executable, "-m", "tools.demo", *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
        )

    cluster = demo("--help")
    assert cluster.returncode == 0, cluster.stderr
    assert "--state-store {hdfs,rocksdb,both}" in cluster.stdout and "--mount" in cluster.stdout
    assert "sos gateway" in cluster.stdout
    mount = demo("--mount", "--help")
    assert mount.returncode == 0, mount.stderr
    assert mount.stdout.startswith("usage: scripts/demo --mount")
    assert "--kill {both,mount}" in mount.stdout
    # too few batches for the three losses: a usage error, before anything starts
    short = demo("--batches", "4")
    assert short.returncode == 2 and "--batches 5 or more" in short.stderr, short.stderr
    assert "--mount" in (ROOT / "scripts" / "demo").read_text()
