"""CPU time of one start of each command the tests run most (issue 27 item 4): user + system
seconds per run, the mean over --runs runs of a fresh interpreter each, from the children's
rusage (resource.RUSAGE_CHILDREN), so the machine's load changes the figures less than wall
time would. The commands run from this checkout (PYTHONPATH), with this interpreter's venv.

    python -m bench.startup [--runs 10] [--only NAME,...] [--root CHECKOUT] [--bytecode]

"against nothing": a real command whose server does not answer (127.0.0.1:1 refuses), so the
figure is the command's start-up, its parse and its imports up to the connection.

--root: the checkout whose code runs (default: this one), e.g. another worktree at main for a
before/after; nothing is written into it. --bytecode: the commands write and read bytecode in a
temporary PYTHONPYCACHEPREFIX (PYTHONDONTWRITEBYTECODE unset; each command's first, unmeasured
run writes it), as on a machine that keeps bytecode, Python's default; without it, what the
environment does (with PYTHONDONTWRITEBYTECODE=1 and no __pycache__ in the checkout, every
process compiles every module of the checkout it imports from source).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
        "import the gateway's workers": [py, "-c", "import spark_plugin.gateway.workers"],
        "import sos_server.serve": [py, "-c", "import sos_server.serve"],
    }


def cpu_per_run(argv: list[str], runs: int, env: dict[str, str]) -> tuple[float, float]:
    """(user, system) CPU seconds per run of *argv*, each run a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(runs):
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) / runs, (after.ru_stime - before.ru_stime) / runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--only", default="", help="comma-separated names (a prefix is enough)")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose code runs (default: this one)")
    p.add_argument("--bytecode", action="store_true", help="keep bytecode, in a temporary folder (see above)")
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=str(args.root.resolve()), SOS_KEY=KEY)
    env.pop("SOS_KEY_FILE", None)
    bytecode = (
        " (bytecode kept)" if args.bytecode else f" (PYTHONDONTWRITEBYTECODE={env.get('PYTHONDONTWRITEBYTECODE', '')})"
    )
    print(f"{args.root}{bytecode}: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {args.runs} runs each")
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="sos-startup-"))
        if args.bytecode:
            env["PYTHONPYCACHEPREFIX"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="sos-pyc-"))
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        for name, argv in commands(work).items():
            if args.only and not any(name.startswith(o) for o in args.only.split(",")):
                continue
            subprocess.run(argv, env=env, capture_output=True, check=False)  # the page cache; --bytecode's pycs
            user, system = cpu_per_run(argv, args.runs, env)
            print(f"{name:44} user {user:.3f} s  sys {system:.3f} s  total {user + system:.3f} s", flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
