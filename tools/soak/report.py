"""What a run prints at the end: a few lines of figures, where the logs are, and last
``SOAK-RESULT {json}`` (what tests/spark/test_soak.py reads)."""

from __future__ import annotations

import json
import shutil


def report(result: dict, kinds: tuple[str, ...], *, cluster: bool, code: int, work: str, keep: bool) -> None:
    """Print the figures of ``result`` (the harness's summary) and the SOAK-RESULT line; the
    work directory is removed after a success unless ``keep``."""
    k = result["kills"]
    print(
        f"kill events: {result['kill_events']} ("
        + ", ".join(f"{kind} {k[kind]}" for kind in kinds)
        + f") in {result['duration_s']:.0f}s = {result['kills_per_hour']:.0f}/h",
        flush=True,
    )
    if cluster:
        g = result["gateway_restarts"]
        print(
            f"gateway restarts after a gateway kill: {g['same-cache']} on the same cache, "
            f"{g['empty-cache']} on an empty cache; processes SIGKILLed: "
            + ", ".join(f"{n} {w}" for w, n in result["processes_killed"].items()),
            flush=True,
        )
        if "failovers" in g:  # --gateway-pair
            print(
                f"gateway pair: {g['failovers']} failovers to the standby (median "
                f"{result['failover_median_s']}s, max {result['failover_max_s']}s from the "
                f"kill or pause to its promotion), {g['split-brain-refused']} split-brain "
                f"attempts refused",
                flush=True,
            )
    print(
        f"restores after total loss: {result['restores']['sos-restore']} via sos restore, "
        f"{result['restores']['empty-cache']} via a "
        f"{'gateway' if cluster else 'mount'} on an empty cache; "
        f"query restarted in the same JVM {result['query_restarts_same_jvm']} times; "
        f"driver processes started {result['driver_starts']} "
        f"({result['spare_driver_promotions']} took over as warm spares)",
        flush=True,
    )
    print(
        f"checks: {result['checks']}, records checked {result['records_checked']} "
        f"(final {result['records_final']} of {result['batches_committed']} batches); "
        f"violations {len(result['violations'])}",
        flush=True,
    )
    rec = result["median_recovery_s"]
    print(
        "median time from a kill to the next committed batch: "
        + ", ".join(f"{k} {rec[k]}s" for k in kinds if rec[k] is not None),
        flush=True,
    )
    pct = result.get("recovery_p50_p99_s", {})
    stopped = result.get("stopped_queries", {})
    print(
        "stopped queries per kill event (goal 0 for gateway kills and failovers), and the "
        "batch delay each caused (kill -> next commit, p50/p99): "
        + ", ".join(
            f"{k} {stopped.get(k, 0)}/{result['kills'][k]}" + (f" ({pct[k][0]}s/{pct[k][1]}s)" if k in pct else "")
            for k in kinds
            if result["kills"].get(k)
        ),
        flush=True,
    )
    if result["unexpected"] or result["query_failures"]:
        print(
            f"unexpected exits: {len(result['unexpected'])}; query failures not caused by a "
            + ("mount kill" if not cluster else "driver kill (restarted in the same driver)")
            + f": {len(result['query_failures'])} (see SOAK-RESULT)",
            flush=True,
        )
    if code != 0 or keep:
        print(
            f"logs kept in {work} (logs/events.log, server.log, "
            + ("gatewayN.log, clusterN/logs/" if cluster else "mountN.log, driverN.log")
            + ")",
            flush=True,
        )
    else:
        shutil.rmtree(work, ignore_errors=True)
    result["exit"] = code
    result["workdir"] = work if (code != 0 or keep) else None
    print("SOAK-RESULT " + json.dumps(result, sort_keys=True), flush=True)
