"""The crash campaign: N runs per scenario of ``kill -9`` against ``sandlot serve`` (not a test).

    .venv/bin/python bench/crash.py --runs 100 [--scenario create --scenario exec …] [--seed S]

Needs root, crun, iproute2 and nftables (the ``local`` backend). Each scenario gets a fresh
home and server; every run fires operations, kills the server at a random moment, restarts it,
retries the keyed operations and checks the invariants (``tests/crash/harness.py`` says which).
Prints one line per failing run (with its seed) and a table of the counts, which must all be 0.
Exits 1 when any count is not.
"""

from __future__ import annotations

import argparse
import importlib.util
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

_HARNESS = Path(__file__).resolve().parents[1] / "tests" / "crash" / "harness.py"


def _load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sandlot_crash_harness", _HARNESS)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    harness = _load_harness()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="runs per scenario")
    parser.add_argument(
        "--scenario", action="append", choices=harness.SCENARIOS, help="repeatable; default all"
    )
    parser.add_argument("--seed", default=None, help="campaign seed (default: random)")
    parser.add_argument("--keep", action="store_true", help="keep the homes and server logs")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per run")
    args = parser.parse_args()
    problem = harness.missing_prerequisite()
    if problem:
        print(f"crash campaign skipped: needs {problem}", file=sys.stderr)
        return 2
    seed = args.seed or secrets.token_hex(4)
    scenarios = args.scenario or list(harness.SCENARIOS)
    print(f"seed {seed}; {args.runs} runs per scenario: {', '.join(scenarios)}", flush=True)
    rows = []
    for scenario in scenarios:
        root = Path(tempfile.mkdtemp(prefix=f"sandlot-crash-{scenario}-"))
        suite = harness.CrashSuite(root, seed=seed)
        reports = []
        started = time.monotonic()
        try:
            suite.start()
            for n in range(args.runs):
                try:
                    report = suite.run(scenario, n)
                except Exception as e:  # a run the harness could not finish is a failure too
                    print(f"{scenario} #{n}: harness error: {e}", flush=True)
                    print(f"--- server log ---\n{suite.server.tail(60)}\n---", flush=True)
                    report = harness.RunReport(scenario, n, f"{seed}:{scenario}:{n}")
                    report.inconsistent.append(f"harness error: {e}")
                reports.append(report)
                if not report.clean:
                    print(report.describe(), flush=True)
                elif args.verbose:
                    again = "" if report.second_kill is None else f" and {report.second_kill:.2f}s"
                    print(
                        f"{scenario} #{n}: kill at {report.kill_after:.3f}s{again}, "
                        f"{report.in_flight}/{report.ops} in flight, recovered {report.recovered}, "
                        f"{report.seconds:.1f}s",
                        flush=True,
                    )
                elif (n + 1) % 10 == 0:
                    print(f"{scenario}: {n + 1} runs clean so far", flush=True)
        finally:
            forced = suite.close()
            if forced:
                print(f"{scenario}: had to remove at close: {forced}", flush=True)
            if not args.keep:
                import shutil

                shutil.rmtree(root, ignore_errors=True)
            else:
                print(f"{scenario}: kept {root}")
        elapsed = time.monotonic() - started
        rows.append((scenario, reports, elapsed, forced))
    print()
    header = (
        f"{'scenario':<9} {'runs':>4} {'ops':>5} {'in flight':>9} {'intents':>8} "
        f"{'orphans':>7} {'double alloc':>12} {'inconsistent':>12} {'wrong replays':>13} "
        f"{'re-runs':>7} {'s/run p50':>9} {'total s':>7}"
    )
    print(header)
    print("-" * len(header))
    bad = False
    for scenario, reports, elapsed, forced in rows:
        total = {name: sum(r.counts()[name] for r in reports) for name in harness.COUNTS}
        total["orphans"] += len(forced)
        bad = bad or any(total.values())
        intents = sum(r.recovered.get("intents", 0) for r in reports)
        p50 = statistics.median(r.seconds for r in reports) if reports else 0.0
        print(
            f"{scenario:<9} {len(reports):>4} {sum(r.ops for r in reports):>5} "
            f"{sum(r.in_flight for r in reports):>9} {intents:>8} {total['orphans']:>7} "
            f"{total['double_allocations']:>12} {total['inconsistent']:>12} "
            f"{total['wrong_replays']:>13} {total['reruns']:>7} {p50:>9.2f} {elapsed:>7.0f}"
        )
    print(
        "\nin flight: operations with no definitive answer when the server died; intents: "
        "intents the restarted server settled at start-up."
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
