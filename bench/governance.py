"""What the policy gate and the receipts cost a caller, against same-run baselines.

Rows:

- ``subprocess.run(["true"])`` on the host: the floor any exec pays.
- exec of ``true`` through the Manager *without* a gate, and *with* the gate (normalize ->
  Cedar decision -> signed decision receipt -> exec -> signed execution receipt), on the ``fake``
  backend (isolates the gate) and on the ``local`` backend when it works here.
- The policy decision alone and the signed receipt append alone come from ``bench/policy.py``
  and ``bench/receipts.py``, run here with ``--quick`` so their baselines share this run.

Usage: ``.venv/bin/python bench/governance.py [--execs N] [--no-sub]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sandlot.backends.base import Backend
from sandlot.backends.registry import Backends
from sandlot.manager import Manager
from sandlot.sdk import AsyncSandlot
from sandlot.store.sql import SqlStore
from sandlot.testing import FakeBackend

HERE = Path(__file__).resolve().parent


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, samples: list[float], base: float | None) -> str:
    p50, p99 = statistics.median(samples), pct(samples, 0.99)
    extra = f"{p50 - base:+8.3f}" if base is not None else " " * 8
    return f"| {name:<52} | {p50:8.3f} | {p99:8.3f} | {extra} |"


def bare(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["true"], check=True)
        out.append((time.perf_counter() - t) * 1000)
    return out


async def execs(client_or_manager: AsyncSandlot | Manager, backend: str, n: int) -> list[float]:
    manager = (
        client_or_manager.manager
        if isinstance(client_or_manager, AsyncSandlot)
        else client_or_manager
    )
    spec_fields = {"network": "deny-all"}
    from sandlot.models import SandboxSpec

    info = await manager.create(SandboxSpec.model_validate(spec_fields), backend=backend)
    try:
        for _ in range(5):
            await manager.exec(info.id, ["true"])
        out = []
        for _ in range(n):
            t = time.perf_counter()
            await manager.exec(info.id, ["true"])
            out.append((time.perf_counter() - t) * 1000)
        return out
    finally:
        await manager.destroy(info.id)


async def measure(
    name: str, backend_obj: Backend | None, n: int
) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        extra = {name: backend_obj} if backend_obj is not None else None
        async with AsyncSandlot(home, name, backends=extra) as gated:
            with_gate = await execs(gated, name, n)
        store = SqlStore(f"sqlite:///{home / 'plain.db'}")
        plain = Manager(store, Backends(home, extra=extra), default_backend=name)
        try:
            without = await execs(plain, name, n)
        finally:
            await plain.aclose()
    return without, with_gate


def local_available() -> bool:
    try:
        from sandlot.backends.local import doctor
    except ImportError:
        return False
    return all(c.ok for c in doctor() if c.required)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execs", type=int, default=300)
    parser.add_argument(
        "--no-sub", action="store_true", help="skip the policy and receipts benches"
    )
    args = parser.parse_args()
    n = args.execs
    base = statistics.median(bare(n))
    print(
        f"exec of `true`, {n} runs each (ms); overhead column = p50 minus the bare subprocess p50\n"
    )
    print(f"| {'what':<52} | {'p50':>8} | {'p99':>8} | {'+p50':>8} |")
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    print(row("subprocess.run(['true']) (baseline)", bare(n), None))
    without, with_gate = asyncio.run(measure("fake", FakeBackend(), n))
    print(row("fake backend, Manager without gate", without, None))
    print(
        row(
            "fake backend, Manager with gate + 2 signed receipts",
            with_gate,
            statistics.median(without),
        )
    )
    if local_available():
        without, with_gate = asyncio.run(measure("local", None, n))
        print(row("local backend (crun), Manager without gate", without, base))
        print(row("local backend (crun), with gate + 2 signed receipts", with_gate, base))
    else:
        print(f"| {'local backend: not available here':<52} | {'':>8} | {'':>8} | {'':>8} |")
    print("\nThe gate's cost is the fake rows' difference (the fake's exec does no work).")
    if not args.no_sub:
        for script, extra_args in (("policy.py", []), ("receipts.py", ["--quick"])):
            print(f"\n== bench/{script} ==", flush=True)
            subprocess.run([sys.executable, str(HERE / script), *extra_args], check=False)


if __name__ == "__main__":
    main()
