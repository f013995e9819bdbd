"""What ``strict`` enforcement costs: per decided ``execve``, and on real work, against the
default mode measured in the same run.

Per ``execve`` (µs): a Python loop runs ``subprocess.run(["/bin/true", ...])`` N times and times
each spawn. Rows:

- host, bare: the loop with no filter; the baseline.
- host, notifier: the same loop under an exec-notify seccomp filter whose fd is held by
  :class:`~sandlot.backends.local.execgate.ExecGate` with a decision that allows everything (the
  floor of strict: the kernel stop, reading argv from the caller, the answer). The filter is
  loaded by the stand-in for crun the notifier's tests use (``tests/unit/local/notify_standin.py``).
- sandbox standard / strict: the loop inside real ``local`` sandboxes through the SDK (crun, the
  default Cedar policy, signed receipts), with the same argv each time (in strict, after the
  first, an allow from the per-boot cache) and with a new argv each time (in strict, each one a
  gate decision and a receipt).

Workloads (s, median over rounds, each round in fresh sandboxes of both modes): a unittest suite
of 40 tests that spawn ``sh``, ``tr``, ``wc``, ``grep`` and ``python3`` (its first run, every
argv new to the cache, and a repeat), and ``pip install`` of a local sdist (``--no-index``; pip
runs setuptools in subprocesses under fresh temporary names, so strict decides each of them).

Rounds interleave the modes (and alternate which goes first) so that a busy machine slows both
alike. Usage::

    .venv/bin/python bench/strict.py [--n 1000] [--rounds 5] [--no-sandbox] [--no-workload]

Needs root (seccomp filters with user notification, the memory of another process) and crun.
Not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sandlot.backends.local.execgate import ExecCall, ExecGate

STANDIN = Path(__file__).resolve().parents[1] / "tests" / "unit" / "local" / "notify_standin.py"
MODES = ("standard", "strict")

LOOP = """
import subprocess, sys, time
n, kind, tag = int(sys.argv[1]), sys.argv[2], sys.argv[3]
out = []
for i in range(n):
    argv = ["/bin/true"] if kind == "same" else ["/bin/true", tag, str(i)]
    t = time.perf_counter_ns()
    subprocess.run(argv, check=True)
    out.append(time.perf_counter_ns() - t)
print(" ".join(str(x) for x in out))
"""

SUITE = """
import subprocess, sys, unittest


class Work(unittest.TestCase):
    pass


def make(i):
    def test(self):
        r = subprocess.run(
            ["sh", "-c", f"echo {i} | tr 0-9 a-j | wc -c"], capture_output=True, text=True
        )
        self.assertEqual(int(r.stdout), len(str(i)) + 1)
        r = subprocess.run(["grep", "-c", "x"], input="x\\ny\\nx\\n", capture_output=True, text=True)
        self.assertEqual(r.stdout, "2\\n")
        if i % 8 == 0:
            r = subprocess.run([sys.executable, "-c", f"print({i} * 2)"], capture_output=True)
            self.assertEqual(int(r.stdout), i * 2)
    return test


for i in range(40):
    setattr(Work, f"test_{i:02}", make(i))
"""

SETUP = (
    "from setuptools import setup\nsetup(name='tinypkg', version='1.0', py_modules=['tinypkg'])\n"
)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def host_loop(listener: str, n: int, kind: str, tag: str) -> list[float]:
    out = subprocess.run(
        [sys.executable, str(STANDIN), listener, sys.executable, "-c", LOOP, str(n), kind, tag],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return [int(ns) / 1000 for ns in out.stdout.split()]


def host_rows(n: int, rounds: int) -> tuple[dict[str, list[float]], int]:
    decided = 0

    def allow(call: ExecCall) -> bool:
        nonlocal decided
        decided += 1
        return True

    rows: dict[str, list[float]] = {"host, bare": [], "host, notifier (allow all)": []}
    with tempfile.TemporaryDirectory() as tmp:
        gate = ExecGate(Path(tmp) / "listener.sock", allow)
        try:
            for r in range(rounds):
                for name, listener in (("host, bare", "-"), ("host, notifier (allow all)", None)):
                    path = gate.listener_path if listener is None else listener
                    rows[name] += host_loop(path, n, "same", str(r))
        finally:
            gate.close()
    return rows, decided


async def sandbox_rows(n: int, rounds: int) -> dict[str, list[float]]:
    from sandlot.sdk import AsyncSandlot

    rows: dict[str, list[float]] = {
        f"sandbox {mode}, {kind} argv": [] for kind in ("same", "new") for mode in MODES
    }
    with tempfile.TemporaryDirectory() as home:
        async with AsyncSandlot(home) as client:
            sbs = {
                mode: await client.create(
                    network="deny-all", backend_options={"local": {"enforcement": mode}}
                )
                for mode in MODES
            }
            try:
                for r in range(rounds):
                    for mode in MODES if r % 2 == 0 else MODES[::-1]:
                        for kind in ("same", "new"):
                            argv = ["python3", "-c", LOOP, str(n), kind, f"r{r}"]
                            res = await sbs[mode].exec(argv, timeout=600)
                            rows[f"sandbox {mode}, {kind} argv"] += [
                                int(x) / 1000 for x in res.stdout.split()
                            ]
            finally:
                for sb in sbs.values():
                    await sb.destroy()
    return rows


async def workload_rows(rounds: int) -> tuple[dict[str, dict[str, list[float]]], dict[str, int]]:
    from sandlot.receipts.receipt import Receipt
    from sandlot.sdk import AsyncSandlot

    names = ("test suite, first run", "test suite, repeat", "pip install of an sdist")
    times: dict[str, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in names}
    decided: dict[str, int] = dict.fromkeys(names, 0)
    programs = 0

    def count(receipt: Receipt) -> None:
        nonlocal programs
        if receipt.body.get("op") == "exec.program" and "decision" in receipt.body:
            programs += 1

    with tempfile.TemporaryDirectory() as home:
        async with AsyncSandlot(home, on_receipt=count) as client:
            for r in range(rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    options = {"local": {"enforcement": mode}}
                    async with await client.create(
                        network="deny-all", backend_options=options
                    ) as sb:
                        await sb.write_file("/workspace/test_work.py", SUITE)
                        await sb.write_file("/workspace/pkg/setup.py", SETUP)
                        await sb.write_file("/workspace/pkg/tinypkg.py", "X = 1\n")
                        commands = (
                            "python3 -m unittest -q test_work",
                            "python3 -m unittest -q test_work",
                            f"python3 -m pip install -q --no-index --no-build-isolation"
                            f" --no-deps --target /tmp/t{r} /workspace/pkg",
                        )
                        for name, command in zip(names, commands, strict=True):
                            await client.manager.flush_receipts()
                            before = programs
                            t = time.perf_counter()
                            res = await sb.exec(command, timeout=600)
                            times[name][mode].append(time.perf_counter() - t)
                            if res.exit_code != 0:
                                msg = f"{name} failed in {mode}: {res.stderr[-2000:]}"
                                raise RuntimeError(msg)
                            await client.manager.flush_receipts()
                            if mode == "strict":
                                decided[name] += programs - before
    return times, {k: v // rounds for k, v in decided.items()}


def print_execs(rows: dict[str, list[float]]) -> None:
    print(f"{'':34}{'p50 µs':>10}{'p90 µs':>10}{'mean µs':>10}{'n':>7}")
    for name, xs in rows.items():
        row = [pct(xs, 0.5), pct(xs, 0.9), statistics.fmean(xs)]
        print(f"{name:34}" + "".join(f"{v:10.1f}" for v in row) + f"{len(xs):7}")


def print_added(name: str, base: list[float], over: list[float]) -> None:
    added = [pct(over, q) - pct(base, q) for q in (0.5, 0.9)]
    added.append(statistics.fmean(over) - statistics.fmean(base))
    print(f"{name:34}" + "".join(f"{v:10.1f}" for v in added))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="spawns per loop on the host")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-sandbox", action="store_true", help="only the host rows")
    parser.add_argument("--no-workload", action="store_true", help="no workload table")
    args = parser.parse_args()

    # The host's load is part of the result: wake-ups dominate the round trip, and they
    # wait for a CPU.
    load = os.getloadavg()[0]
    rows, decided = host_rows(args.n, args.rounds)
    if not args.no_sandbox:
        rows |= asyncio.run(sandbox_rows(max(50, args.n // 5), args.rounds))
    print(f"\nper execve: subprocess.run of /bin/true, {args.rounds} interleaved rounds")
    print(f"(the host notifier decided {decided} exec calls; load average {load:.1f})\n")
    print_execs(rows)
    print(f"\n{'added by strict (same run)':34}{'p50 µs':>10}{'p90 µs':>10}{'mean µs':>10}")
    print_added("host: notifier - bare", rows["host, bare"], rows["host, notifier (allow all)"])
    if not args.no_sandbox:
        for kind in ("same", "new"):
            base, over = (
                rows[f"sandbox standard, {kind} argv"],
                rows[f"sandbox strict, {kind} argv"],
            )
            label = "cached allow" if kind == "same" else "decided + receipt"
            print_added(f"sandbox: {kind} argv ({label})", base, over)
    if args.no_sandbox or args.no_workload:
        return
    times, programs = asyncio.run(workload_rows(args.rounds))
    print(f"\nworkloads: median wall time of sb.exec over {args.rounds} rounds", end="")
    print(f" (load average {os.getloadavg()[0]:.1f})\n")
    print(f"{'':28}{'standard s':>11}{'strict s':>11}{'overhead':>10}{'decided':>9}")
    for name, by_mode in times.items():
        d, s = (statistics.median(by_mode[m]) for m in MODES)
        print(f"{name:28}{d:11.3f}{s:11.3f}{(s / d - 1) * 100:9.1f}%{programs[name]:9}")


if __name__ == "__main__":
    main()
