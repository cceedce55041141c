"""The command (``scripts/soak``, ``python -m tools.soak``): options, the run, the exit code.

Exit 0: no violation; 1: a violation (the work directory with every log is kept and its
path printed); 2: the harness could not do its job (a process would not start, a stall).
The last line is ``SOAK-RESULT {json}``.

``python -m tools.soak --help``; ``_driver CONFIG`` is the driver process's entry.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import traceback

from tools.soak.cluster_mode import ClusterSoak
from tools.soak.common import (
    CLUSTER_KINDS,
    CLUSTER_WEIGHTS,
    DEFAULT_WEIGHTS,
    DESCRIPTION,
    KINDS,
    HarnessError,
    Violation,
)
from tools.soak.driver import driver_main
from tools.soak.harness import Soak
from tools.soak.report import report

#: the kinds only --gateway-pair has (tools.soak.pair_mode.PAIR_KINDS)
PAIR_ONLY = ("zombie", "standby")


def _weights(text: str, defaults: dict | None = None) -> dict:
    """``kind=w,...`` over ``defaults`` (the mode's weights; a kind of neither mode is an
    error; the mode checks its own kinds)."""
    w = dict(defaults or {})
    for part in text.split(","):
        if not part.strip():
            continue
        k, _, v = part.partition("=")
        if k.strip() not in (*KINDS, *CLUSTER_KINDS, *PAIR_ONLY):
            raise argparse.ArgumentTypeError(
                f"unknown kind {k!r}: one of {', '.join(KINDS)} (mount mode) or "
                f"{', '.join(CLUSTER_KINDS)} (--cluster), and {', '.join(PAIR_ONLY)} "
                f"(--cluster --gateway-pair)"
            )
        w[k.strip()] = float(v)
    return w


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_driver":
        return driver_main(argv[1])
    p = _parser()
    args = p.parse_args(argv)
    cls = ClusterSoak if args.cluster else Soak
    defaults = CLUSTER_WEIGHTS if args.cluster else DEFAULT_WEIGHTS
    if args.gateway_pair:
        if not args.cluster:
            p.error("--gateway-pair goes with --cluster")
        from tools.soak.pair_mode import PAIR_WEIGHTS, PairSoak

        cls, defaults = PairSoak, PAIR_WEIGHTS
    weights = dict(defaults, **args.weights)
    wrong = sorted(set(weights) - set(cls.KINDS))
    if wrong:
        p.error(f"--weights: {', '.join(wrong)} is no kind of the {cls.MODE} mode ({', '.join(cls.KINDS)})")
    work = args.workdir or tempfile.mkdtemp(prefix="sos-soak-")
    os.makedirs(work, exist_ok=True)
    soak = cls(
        duration=args.duration,
        seed=args.seed,
        workdir=work,
        rows=args.rows,
        max_kills=args.max_kills,
        weights=weights,
        state_store=args.state_store,
        ahead=args.ahead,
        stall_timeout=args.stall_timeout,
        delay=tuple(args.delay),
        standby=args.standby,
        durability=args.durability,
    )
    code, result = _run(soak)
    report(result, cls.KINDS, cluster=args.cluster, code=code, work=work, keep=args.keep)
    return code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/soak", description=DESCRIPTION)
    p.add_argument("--duration", type=float, default=300, help="seconds of crash loop (default 300)")
    p.add_argument("--seed", type=int, default=1, help="RNG seed of the kill schedule (default 1)")
    p.add_argument("--max-kills", type=int, default=None, help="stop after this many kill events even if time is left")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="cluster mode: a Spark standalone cluster (Master, two 1-core Workers, "
        "driver, each a node with its own local disk) checkpointing through "
        "`sos gateway`; kills of gateway, server, executor, worker, driver, all",
    )
    p.add_argument(
        "--gateway-pair",
        action="store_true",
        help="--cluster with a gateway pair: an active `sos gateway --lease 5s` and a "
        "`--standby`, the query on webhdfs://<nameservice> over both; kills of "
        "the active (gateway), split-brain attempts (zombie: the active paused "
        "past its lease, resumed, sent a write), kills of the standby",
    )
    p.add_argument(
        "--weights",
        type=_weights,
        default={},
        help="relative frequency of each kind, e.g. server=5,mount=2,driver=1,all=1 "
        "(--cluster: gateway=4,server=1,executor=2,worker=2,driver=1,all=1)",
    )
    p.add_argument(
        "--delay",
        type=float,
        nargs=2,
        default=(0.3, 3.0),
        metavar=("MIN", "MAX"),
        help="seconds between a restart and the next kill (uniform, default 0.3 3)",
    )
    p.add_argument("--rows", type=int, default=20, help="new record ids per input file/batch")
    p.add_argument("--ahead", type=int, default=2, help="input files fed ahead of the query")
    p.add_argument("--state-store", choices=("hdfs", "rocksdb"), default="hdfs")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=240,
        help="seconds without a committed batch before the run gives up (exit 2)",
    )
    p.add_argument(
        "--no-spare",
        dest="standby",
        action="store_false",
        help="start every replacement driver cold (default: keep one warm spare "
        "driver process with its SparkSession up to replace a killed driver, while an "
        "event still to come needs one)",
    )
    p.add_argument(
        "--durability",
        choices=("server", "tier"),
        default="server",
        help="the mount's (--cluster: the gateways') --durability (default server). tier: "
        "the server runs with --tier on a bucket (moto's S3 server) and every barrier "
        "returns once the bucket holds it, so a disk event deletes the server's disk at a "
        "random moment without freezing the writer or waiting for the bucket (RPO 0 still)",
    )
    p.add_argument("--workdir", help="work directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory on success")
    return p


def _run(soak: Soak) -> tuple[int, dict]:
    """Run the crash loop; (exit code, result): 0 ok, 1 a violation, 2 a harness error or
    an interruption (SIGINT, SIGTERM). Whatever happens, what is left is cleaned up."""

    def on_term(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)
    code = 0
    result = None
    try:
        result = soak.run()
    except Violation as exc:
        soak.violations.append(str(exc))
        soak.say(f"VIOLATION: {exc}")
        code = 1
    except HarnessError as exc:
        soak.say(f"HARNESS ERROR: {exc}")
        code = 2
    except KeyboardInterrupt as exc:
        soak.say(f"interrupted ({exc or 'SIGINT'})")
        code = 2
    except Exception as exc:
        soak.say(f"HARNESS ERROR: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 2
    finally:
        try:
            soak.cleanup()
        except Exception as exc:
            print(f"cleanup: {exc!r}", file=sys.stderr)
    if result is None:
        result = soak.summary()
        result["ok"] = False
    return code, result
