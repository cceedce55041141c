"""CPU time of one start of each command the tests run most (issue 27 item 4): user + system
seconds of one run, the median over --runs runs of a fresh interpreter each, from its own
rusage (wait4), so the machine's load changes the figures less than wall time would. The commands run from this checkout (PYTHONPATH), with this interpreter's venv.

    python -m bench.startup [--runs N] [--only NAME,...] [--root DIR] [--before DIR] [--bytecode] [--valgrind]

"against nothing": a real command whose server does not answer (127.0.0.1:1 refuses), so the
figure is the command's start-up, its parse and its imports up to the connection.

--root: the checkout whose code runs (default: this one); --before: another one (e.g. ``git
archive main | tar -x -C /tmp/base``) measured beside it, command by command, so that both see
the same load; nothing is written into either. --valgrind: instructions executed instead (one run
under valgrind's callgrind), a figure the load does not change. --bytecode: the commands write and read bytecode in a
temporary PYTHONPYCACHEPREFIX (PYTHONDONTWRITEBYTECODE unset; each command's first, unmeasured
run writes it), as on a machine that keeps bytecode, Python's default; without it, what the
environment does (with PYTHONDONTWRITEBYTECODE=1 and no __pycache__ in the checkout, every
process compiles every module of the checkout it imports from source).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the commands' working directory: not a checkout (``python -m``/``-c`` put it first on sys.path)
CWD = "/"
BIN = Path(sys.executable).parent
#: a key of the right form (what `sos-server keygen` prints): the commands "against nothing" get as far
#: as the connection
KEY = "70cb3ef3b083dc1c." + "5" * 64


def commands(work: str) -> dict[str, list[str]]:
    """name -> argv. The console scripts (``sos``, ``sos-server``) are this venv's, as CI's."""
    py, sos, srv = sys.executable, str(BIN / "sos"), str(BIN / "sos-server")
    nothing = ["--server", "127.0.0.1:1", "--timeout", "1"]
    return {
        "python -c pass": [py, "-c", "pass"],
        "sos --help": [sos, "--help"],
        "sos ls NS (nothing)": [sos, "ls", "ns", *nothing],
        "sos put F NS/x (nothing)": [sos, "put", __file__, "ns/x", *nothing],
        "sos verify NS (nothing)": [sos, "verify", "ns", *nothing],
        "sos restore --help": [sos, "restore", "--help"],
        "sos gateway --help": [sos, "gateway", "--help"],
        "sos mount --help": [sos, "mount", "--help"],
        "sos-server --help": [srv, "--help"],
        "sos-server serve --help": [srv, "serve", "--help"],
        "sos-server keygen": [srv, "keygen", "--data", work, "--role", "append", "ns"],
        "python -m sos_server.cli --help": [py, "-m", "sos_server.cli", "--help"],
        "python -m sos_client.cli --help": [py, "-m", "sos_client.cli", "--help"],
        "python -m spark_plugin.gateway.cli --help": [py, "-m", "spark_plugin.gateway.cli", "--help"],
        "python -m spark_plugin.mount.cli --help": [py, "-m", "spark_plugin.mount.cli", "--help"],
        "import the fsspec filesystem": [py, "-c", "import fsspec; fsspec.get_filesystem_class('sos')"],
        "import a gateway's run": [py, "-c", "import spark_plugin.gateway.cli, spark_plugin.gateway.run"],
        "import the gateway's workers": [py, "-c", "import spark_plugin.gateway.workers"],
        "import sos_server.serve": [py, "-c", "import sos_server.serve"],
    }


def cpu_of_one_run(argv: list[str], env: dict[str, str]) -> float:
    """User + system CPU seconds of one run of *argv* in a fresh process (its own rusage)."""
    proc = subprocess.Popen(argv, env=env, cwd=CWD, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _pid, _status, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0  # reaped here; Popen must not wait for it again
    return usage.ru_utime + usage.ru_stime


def instructions(argv: list[str], env: dict[str, str]) -> float:
    """Millions of instructions one run of *argv* executes (valgrind's callgrind): the same
    figure whatever the load, at ~40x the run's time."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv],
        env=env,
        cwd=CWD,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    ).stderr
    refs = [line for line in out.splitlines() if "Collected :" in line]
    return int(refs[-1].rsplit(":", 1)[1]) / 1e6


def measure(argv: list[str], runs: int, envs: list[dict[str, str]], *, valgrind: bool = False) -> list[float]:
    """The median CPU seconds per run of *argv* under each of *envs*, their runs interleaved
    (A B A B ...: a burst of load falls on both), after one unmeasured run each (the page
    cache; --bytecode's pycs)."""
    for env in envs:
        subprocess.run(argv, env=env, cwd=CWD, capture_output=True, check=False)
    if valgrind:
        return [instructions(argv, env) for env in envs]
    samples: list[list[float]] = [[] for _ in envs]
    for _ in range(runs):
        for env, got in zip(envs, samples):
            got.append(cpu_of_one_run(argv, env))
    return [statistics.median(got) for got in samples]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--only", default="", help="comma-separated names (a prefix is enough)")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose code runs (default: this one)")
    p.add_argument("--before", type=Path, help="another checkout, measured beside --root command by command")
    p.add_argument("--bytecode", action="store_true", help="keep bytecode, in a temporary folder (see above)")
    p.add_argument(
        "--valgrind", action="store_true", help="millions of instructions of one run (callgrind) instead of CPU time"
    )
    args = p.parse_args()
    roots = [r.resolve() for r in (args.before, args.root) if r is not None]
    envs = [dict(os.environ, PYTHONPATH=str(root), SOS_KEY=KEY) for root in roots]
    mode = (
        "bytecode kept" if args.bytecode else f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')}"
    )
    unit = "millions of instructions per run" if args.valgrind else f"CPU s per run, median of {args.runs}"
    print(f"{' vs '.join(map(str, roots))} ({mode}): {unit}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="sos-startup-"))
        pycache = stack.enter_context(tempfile.TemporaryDirectory(prefix="sos-pyc-")) if args.bytecode else None
        for env in envs:
            env.pop("SOS_KEY_FILE", None)
            if pycache is not None:
                env["PYTHONPYCACHEPREFIX"] = pycache
                env.pop("PYTHONDONTWRITEBYTECODE", None)
        for name, argv in commands(work).items():
            if args.only and not any(name.startswith(o) for o in args.only.split(",")):
                continue
            figures = measure(argv, args.runs, envs, valgrind=args.valgrind)
            ratio = f"  ({figures[1] / figures[0]:.2f}x)" if len(figures) == 2 and figures[0] else ""
            print(f"{name:44} {'  '.join(f'{f:.3f}' if f < 100 else f'{f:.0f}' for f in figures)}{ratio}", flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
