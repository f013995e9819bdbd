"""What ``strict`` enforcement adds to each ``execve``: the notifier's round trip.

A process spawns ``/bin/true`` (``posix_spawn`` + ``waitpid``) N times and times each, twice per
round: bare (no filter) and under an exec-notify seccomp filter whose fd is held by
:class:`~sandlot.backends.local.execgate.ExecGate` with a decision that allows everything and
counts (the floor of strict mode: kernel stop, ``/proc/PID/mem`` reads, answer). Rounds
interleave the two so a busy machine slows both alike. The filter is loaded by the stand-in
for crun the notifier's tests use (``tests/unit/local/notify_standin.py``).

A second table runs the same loop in real ``local`` sandboxes through the SDK (crun, the
default Cedar policy, signed receipts), standard and strict side by side: ``/bin/true`` with the
same argv each time (after the first, an allow from the per-boot cache) and with a new argv
each time (each one a gate decision and a receipt).

Usage::

    .venv/bin/python bench/strict.py [--n 2000] [--rounds 5] [--no-sandbox]

Needs root (seccomp filters with user notification, /proc/PID/mem of another process; crun for
the sandbox table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sandlot.backends.local.execgate import ExecCall, ExecGate

STANDIN = Path(__file__).resolve().parents[1] / "tests" / "unit" / "local" / "notify_standin.py"

LOOP = """
import json, os, sys, time
n = int(sys.argv[1])
out = []
for _ in range(n):
    t = time.perf_counter_ns()
    pid = os.posix_spawn("/bin/true", ["true"], {})
    os.waitpid(pid, 0)
    out.append(time.perf_counter_ns() - t)
print(json.dumps(out))
"""


def sample(listener: str, n: int) -> list[float]:
    out = subprocess.run(
        [sys.executable, str(STANDIN), listener, sys.executable, "-c", LOOP, str(n)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return [ns / 1000 for ns in json.loads(out.stdout)]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


SANDBOX_LOOP = """
import os, sys, time
n, same = int(sys.argv[1]), sys.argv[2] == "same"
out = []
for i in range(n):
    t = time.perf_counter_ns()
    pid = os.posix_spawn("/bin/true", ["true"] if same else ["true", str(i)], os.environ)
    os.waitpid(pid, 0)
    out.append(time.perf_counter_ns() - t)
print(" ".join(str(x) for x in out))
"""


async def sandboxes(n: int) -> dict[str, list[float]]:
    from sandlot.sdk import AsyncSandlot

    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as home:
        async with AsyncSandlot(home) as client:
            for mode in ("standard", "strict"):
                options = {"local": {"enforcement": mode}}
                async with await client.create(network="deny-all", backend_options=options) as sb:
                    for kind in ("same", "new"):
                        r = await sb.exec(["python3", "-c", SANDBOX_LOOP, str(n), kind])
                        out[f"{mode}, {kind} argv"] = [int(x) / 1000 for x in r.stdout.split()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-sandbox", action="store_true", help="only the notifier table")
    args = parser.parse_args()
    decided = 0

    def allow(call: ExecCall) -> bool:
        nonlocal decided
        decided += 1
        return True

    bare: list[float] = []
    strict: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        gate = ExecGate(Path(tmp) / "listener.sock", allow)
        try:
            for _ in range(args.rounds):
                bare += sample("-", args.n)
                strict += sample(gate.listener_path, args.n)
        finally:
            gate.close()
    print(f"posix_spawn+wait of /bin/true, {len(bare)} each, {decided} exec calls decided\n")
    print(f"{'':28}{'p50 µs':>10}{'p90 µs':>10}{'p99 µs':>10}{'mean µs':>10}")
    for name, xs in (("bare (baseline, same run)", bare), ("strict (notifier, allow)", strict)):
        row = [pct(xs, 0.5), pct(xs, 0.9), pct(xs, 0.99), statistics.fmean(xs)]
        print(f"{name:28}" + "".join(f"{v:10.1f}" for v in row))
    added = [pct(strict, q) - pct(bare, q) for q in (0.5, 0.9, 0.99)]
    added.append(statistics.fmean(strict) - statistics.fmean(bare))
    print(f"{'added per execve':28}" + "".join(f"{v:10.1f}" for v in added))
    if args.no_sandbox:
        return
    n = max(50, args.n // 10)
    rows = asyncio.run(sandboxes(n))
    print(f"\nin local sandboxes through the SDK, {n} spawns each\n")
    print(f"{'':28}{'p50 µs':>10}{'p90 µs':>10}{'p99 µs':>10}{'mean µs':>10}")
    for name, xs in rows.items():
        row = [pct(xs, 0.5), pct(xs, 0.9), pct(xs, 0.99), statistics.fmean(xs)]
        print(f"{name:28}" + "".join(f"{v:10.1f}" for v in row))


if __name__ == "__main__":
    main()
