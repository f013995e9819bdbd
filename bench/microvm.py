"""The microvm backend's latencies and memory, next to baselines measured in the same run.

Rows: cold boot to a responsive agent (a template build), template restore -> first exec,
exec overhead against a bare ``subprocess.run`` on the host and the ``local`` backend (crun
namespaces; left out, saying why, where it cannot run), verified reset, stop/start with memory, snapshot, and host memory (PSS) per idle
VM. Usage::

    .venv/bin/python bench/microvm.py                 # 20 creates, 100 execs, 1,000 resets
    .venv/bin/python bench/microvm.py --quick         # 5 creates, 20 execs, 20 resets
    .venv/bin/python bench/microvm.py --resets 200

Only two VMs run at a time (our machines have two cores, shared).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from sandlot.backends.base import Backend
from sandlot.backends.microvm import MicrovmBackend, build_image, qemu
from sandlot.models import SandboxSpec, new_id

SPEC = SandboxSpec(network="deny-all")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(name: str, values: list[float], unit: str = "ms") -> None:
    if not values:
        print(f"{name:<44} {'-':>10}")
        return
    print(
        f"{name:<44} {statistics.median(values):>9.1f}{unit} {pct(values, 0.99):>9.1f}{unit}"
        f" {min(values):>9.1f}{unit}  n={len(values)}"
    )


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


async def exec_ms(backend: Backend, ref: str, argv: list[str], n: int) -> list[float]:
    channel = await backend.channel(ref)
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            result = await channel.exec(argv)
            out.append((time.perf_counter() - t) * 1000)
            assert result.exit_code == 0, result.stderr
    finally:
        await channel.close()
    return out


async def local_rows(state: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """The same create -> first exec and warm exec on the ``local`` backend (namespaces)."""
    from sandlot.backends.local import LocalBackend

    local = LocalBackend(state)
    try:
        await local.destroy(await local.create(new_id("sb"), SPEC))  # builds its root fs once
        total = []
        for _ in range(args.creates):
            t0 = time.perf_counter()
            ref = await local.create(new_id("sb"), SPEC)
            channel = await local.channel(ref)
            result = await channel.exec(["true"])
            total.append((time.perf_counter() - t0) * 1000)
            await channel.close()
            assert result.exit_code == 0
            await local.destroy(ref)
        ref = await local.create(new_id("sb"), SPEC)
        execs = await exec_ms(local, ref, ["true"], args.execs)
        await local.destroy(ref)
    finally:
        await local.aclose()
    return {"create -> first exec": total, "exec 'true' (warm)": execs}


async def main(args: argparse.Namespace) -> None:
    image = build_image(progress=lambda line: print(f"  image: {line}", file=sys.stderr))
    with tempfile.TemporaryDirectory(prefix="sandlot-bench-microvm-") as tmp:
        backend = MicrovmBackend(Path(tmp), image=image)
        accel = qemu.decide_accel(image)
        print(f"accelerator: {accel.mode} ({accel.reason})")

        # Baseline: a bare subprocess.run on the host, same run.
        host = []
        for _ in range(args.execs):
            t = time.perf_counter()
            subprocess.run(["true"], check=True)  # noqa: ASYNC221 - the blocking call is the baseline
            host.append((time.perf_counter() - t) * 1000)
        try:
            local = await local_rows(Path(tmp) / "local", args)
        except Exception as e:  # the comparison is optional: say why it is missing
            print(f"local backend left out: {e}", file=sys.stderr)
            local = {}

        t = time.perf_counter()
        first = await backend.create(new_id("sb"), SPEC)  # builds the template: a cold boot
        cold = (time.perf_counter() - t) * 1000
        await backend.destroy(first)

        creates, first_exec, total = [], [], []
        for _ in range(args.creates):
            t0 = time.perf_counter()
            ref = await backend.create(new_id("sb"), SPEC)
            t1 = time.perf_counter()
            channel = await backend.channel(ref)
            result = await channel.exec(["true"])
            t2 = time.perf_counter()
            await channel.close()
            assert result.exit_code == 0
            creates.append((t1 - t0) * 1000)
            first_exec.append((t2 - t1) * 1000)
            total.append((t2 - t0) * 1000)
            await backend.destroy(ref)

        # With a warm pool of one: claim, then the first exec. Each round waits until the
        # detached refill has finished, so the claim measures steady state, not contention.
        pooled = MicrovmBackend(Path(tmp), image=image, pool_size=1)
        await pooled.fill_pool(SPEC)
        pool_total, pool_create = [], []
        pool_dir = Path(tmp) / "pool"

        async def pool_ready() -> None:
            for _wait in range(600):
                if any(p.name.startswith("pool-") for p in pool_dir.glob("*/*")):
                    return
                await anyio.sleep(0.1)

        for _ in range(args.creates):
            await pool_ready()
            await anyio.sleep(1.0)
            t0 = time.perf_counter()
            ref = await pooled.create(new_id("sb"), SPEC)
            t1 = time.perf_counter()
            channel = await pooled.channel(ref)
            result = await channel.exec(["true"])
            t2 = time.perf_counter()
            await channel.close()
            assert result.exit_code == 0
            pool_create.append((t1 - t0) * 1000)
            pool_total.append((t2 - t0) * 1000)
            await pooled.destroy(ref)
        # The refill after the last claim must have finished: a drain that ran before it
        # started would leave its VM running after this directory is gone.
        await pool_ready()
        await pooled.drain_pool()
        await pooled.aclose()

        ref = await backend.create(new_id("sb"), SPEC)
        execs = await exec_ms(backend, ref, ["true"], args.execs)

        pid = qemu.read_pid(backend._vm_dir(ref))
        other = await backend.create(new_id("sb"), SPEC)
        other_pid = qemu.read_pid(backend._vm_dir(other))
        await anyio.sleep(2)
        pss = [pss_kib(p) / 1024 for p in (pid, other_pid) if p]
        await backend.destroy(other)

        resets, restores = [], []
        for _ in range(args.resets):
            t = time.perf_counter()
            report = await backend.reset_to_baseline(ref)
            resets.append((time.perf_counter() - t) * 1000)
            restores.append(report.restore_ms)
            assert report.ok

        stops, starts = [], []
        for _ in range(max(1, args.creates // 4)):
            t = time.perf_counter()
            await backend.stop(ref)
            stops.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            await backend.start(ref, SPEC)
            starts.append((time.perf_counter() - t) * 1000)

        snaps = []
        for i in range(max(1, args.creates // 4)):
            t = time.perf_counter()
            snap = await backend.snapshot(ref, f"bench-{i}")
            snaps.append((time.perf_counter() - t) * 1000)
            await backend.delete_snapshot(snap)
        await backend.destroy(ref)
        await backend.aclose()  # and the create standby it left

        print(f"\n{'what':<44} {'p50':>11} {'p99':>11} {'min':>11}")
        row("baseline: subprocess.run(['true']) on host", host)
        for name, values in local.items():
            row(f"baseline: local backend, {name}", values)
        row("cold boot -> agent (template build)", [cold])
        row("create (template restore + clock set)", creates)
        row("  then first exec", first_exec)
        row("create -> first exec", total)
        row("pool of 1: create (claim)", pool_create)
        row("pool of 1: create -> first exec", pool_total)
        row("exec 'true' (warm)", execs)
        row("reset, verified (3 sources)", resets)
        row("  of which restore to a running VM", restores)
        row("stop (memory to disk)", stops)
        row("start (memory from disk)", starts)
        row("snapshot (memory + disk)", snaps)
        row("host PSS per idle VM (512 MiB guest)", pss, "MiB")
        print()
        for name, values, target in (
            ("create -> first exec", total, 300.0),
            ("reset, verified", resets, 250.0),
        ):
            p50 = statistics.median(values)
            verdict = "met" if p50 <= target else "NOT met"
            print(
                f"target: {name} p50 <= {target:.0f} ms under {accel.mode}: {verdict} ({p50:.0f} ms)"
            )
        try:
            stats = (backend._root / "boot-stats.json").read_text()
        except OSError:
            stats = "{}"
        print(f"cold boots: {stats}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--creates", type=int)
    parser.add_argument("--execs", type=int)
    parser.add_argument("--resets", type=int)
    ns = parser.parse_args()
    ns.creates = ns.creates or (5 if ns.quick else 20)
    ns.execs = ns.execs or (20 if ns.quick else 100)
    ns.resets = ns.resets or (20 if ns.quick else 1000)
    anyio.run(main, ns)
