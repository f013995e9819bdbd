"""The ``local`` backend's latencies, throughput and memory, with same-run baselines and Docker.

Each row is measured three ways in one run: the ``local`` backend (crun by default), a baseline
on the bare host measured interleaved with it (so a busy machine slows both alike), and the same
operation through ``docker run``/``docker exec`` when a Docker engine answers (``DOCKER_HOST`` or
``/var/run/docker.sock``; the column says "no engine" otherwise). Rows: create -> first exec,
cold and from the warm pool; exec overhead of ``true``; exec throughput with 10 sandboxes in
parallel; host memory (PSS) per idle sandbox with 200 running; fork into 100; verified reset,
by restarting the sandbox and by swapping in one from the warm pool.

Usage::

    .venv/bin/python bench/local.py             # the full run (about a quarter of an hour)
    .venv/bin/python bench/local.py --quick     # small counts, for iterating
    .venv/bin/python bench/local.py --no-docker --isolation gvisor

Needs root and crun (runsc for ``--isolation gvisor``). With an engine, the Docker column uses a
busybox image it imports itself (``docker import``; no registry is needed) unless ``--docker-image``
names one that has ``sh``, ``sleep`` and ``true``. Not run in CI.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from sandlot.backends.local import LocalBackend
from sandlot.models import SandboxSpec, new_id
from sandlot.network.service import SandboxNetworks

PYTHON = "/usr/bin/python3"
DOCKER_IMAGE = "sandlot-bench-busybox:1"


@dataclass
class Counts:
    cold: int
    pool: int
    pool_batch: int
    execs: int
    throughput_s: float
    idle: int
    fork: int
    resets: int
    docker_cold: int
    docker_idle: int
    docker_fork: int
    docker_resets: int


FULL = Counts(100, 100, 10, 1000, 10.0, 200, 100, 1000, 30, 200, 100, 100)
QUICK = Counts(10, 10, 5, 100, 2.0, 20, 10, 50, 5, 10, 10, 10)


@dataclass
class Table:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def render(self) -> str:
        head = ("operation", "local", "baseline (same run)", "docker", "target")
        widths = [max(len(r[i]) for r in [head, *self.rows]) for i in range(5)]
        lines = [
            "| " + " | ".join(c.ljust(w) for c, w in zip(head, widths, strict=True)) + " |",
            "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        ]
        lines.extend(
            "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
            for r in self.rows
        )
        return "\n".join(lines)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(values: list[float]) -> str:
    """p50 / p99 of seconds, in milliseconds."""
    if not values:
        return "-"
    return f"{statistics.median(values) * 1000:.1f} / {pct(values, 0.99) * 1000:.1f} ms"


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bare_true() -> None:
    subprocess.run(["true"], check=True)


def bare_python() -> None:
    subprocess.run([PYTHON, "-I", "-S", "-c", "pass"], check=True)


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


# ---------------------------------------------------------------------- the local backend


class Local:
    def __init__(self, root: Path, isolation: str, networks: bool) -> None:
        self.root = root
        self.isolation = isolation
        self.networks = networks
        self.spec = SandboxSpec(
            network="deny-all", backend_options={"local": {"isolation": isolation}}
        )
        self.backends: list[LocalBackend] = []

    def backend(self, name: str, **kwargs: object) -> LocalBackend:
        state = self.root / name
        nets = SandboxNetworks(state / "network") if self.networks else None
        b = LocalBackend(state, networks=nets, **kwargs)  # type: ignore[arg-type]
        self.backends.append(b)
        return b

    async def first_exec(self, backend: LocalBackend) -> tuple[str, float]:
        t = time.perf_counter()
        ref = await backend.create(new_id("bench"), self.spec)
        channel = await backend.channel(ref)
        result = await channel.exec(["true"])
        elapsed = time.perf_counter() - t
        await channel.close()
        assert result.exit_code == 0, result
        return ref, elapsed

    async def many(self, backend: LocalBackend, n: int, limit: int = 4) -> list[str]:
        refs: list[str] = []
        limiter = anyio.CapacityLimiter(limit)

        async def one() -> None:
            async with limiter:
                refs.append(await backend.create(new_id("bench"), self.spec))

        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
        return refs

    async def destroy_all(self, backend: LocalBackend, refs: list[str], limit: int = 4) -> None:
        limiter = anyio.CapacityLimiter(limit)

        async def one(ref: str) -> None:
            async with limiter:
                await backend.destroy(ref)

        async with anyio.create_task_group() as tg:
            for ref in refs:
                tg.start_soon(one, ref)

    async def close(self) -> None:
        for b in self.backends:
            for ref in (await b.list_owned()).values():
                await b.destroy(ref)
            await b.drain_pool()
            await b.aclose()


async def run_local(c: Counts, local: Local, table: dict[str, dict[str, str]]) -> None:
    b = local.backend("main")
    # Warm-up: the root filesystem cache, the compiled agent, crun's seccomp program.
    for _ in range(3):
        ref, _ = await local.first_exec(b)
        await b.destroy(ref)

    print("create -> first exec, cold", flush=True)
    cold, base = [], []
    for _ in range(c.cold):
        ref, t = await local.first_exec(b)
        cold.append(t)
        await b.destroy(ref)
        base.append(await anyio.to_thread.run_sync(timed, bare_python))
    table["cold"] = {"local": ms(cold), "baseline": f"python3 -I -S start {ms(base)}"}

    print("create -> first exec, warm pool", flush=True)
    pooled = local.backend("pool", pool={local.isolation: c.pool_batch})
    warm, base = [], []
    for _ in range(max(1, c.pool // c.pool_batch)):
        await pooled.fill_pool()
        await anyio.sleep(0.5)  # the pool's agents finish starting
        refs = []
        for _ in range(c.pool_batch):
            ref, t = await local.first_exec(pooled)
            warm.append(t)
            refs.append(ref)
            base.append(await anyio.to_thread.run_sync(timed, bare_true))
        await local.destroy_all(pooled, refs)
    table["pool"] = {"local": ms(warm), "baseline": f"subprocess.run(['true']) {ms(base)}"}

    print("exec overhead", flush=True)
    ref = await b.create(new_id("bench"), local.spec)
    channel = await b.channel(ref)
    execs, base = [], []
    for _ in range(c.execs):
        t = time.perf_counter()
        await channel.exec(["true"])
        execs.append(time.perf_counter() - t)
        base.append(await anyio.to_thread.run_sync(timed, bare_true))
    await channel.close()
    await b.destroy(ref)
    over = (statistics.median(execs) - statistics.median(base)) * 1000
    table["exec"] = {
        "local": f"+{over:.2f} ms (exec {ms(execs)})",
        "baseline": f"subprocess.run(['true']) {ms(base)}",
    }

    print("exec throughput, 10 sandboxes", flush=True)
    refs = await local.many(b, 10)
    channels = [await b.channel(r) for r in refs]
    count = [0]
    deadline = time.monotonic() + c.throughput_s

    async def loop(ch: object) -> None:
        while time.monotonic() < deadline:
            await ch.exec(["true"])  # type: ignore[attr-defined]
            count[0] += 1

    t = time.monotonic()
    async with anyio.create_task_group() as tg:
        for ch in channels:
            tg.start_soon(loop, ch)
    rate = count[0] / (time.monotonic() - t)
    for ch in channels:
        await ch.close()
    await local.destroy_all(b, refs)
    base_rate = await anyio.to_thread.run_sync(threaded_rate, bare_true, 10, c.throughput_s)
    table["throughput"] = {
        "local": f"{rate:.0f} execs/s",
        "baseline": f"subprocess.run(['true']) x10 threads {base_rate:.0f}/s",
    }

    print(f"memory, {c.idle} idle sandboxes", flush=True)
    refs = await local.many(b, c.idle)
    await anyio.sleep(3)
    per, cg = [], []
    for r in refs:
        per.append(sum(pss_kib(p) for p in b.host_processes(r)))
        cg.append(cgroup_memory_kib(b, r))
    await local.destroy_all(b, refs)
    bare = await anyio.to_thread.run_sync(idle_python_pss, c.idle)
    kernel = f", cgroup incl. kernel {statistics.mean(cg) / 1024:.1f} MiB" if any(cg) else ""
    table["memory"] = {
        "local": f"{statistics.mean(per) / 1024:.2f} MiB PSS{kernel}",
        "baseline": f"{c.idle} idle python3 -I -S: {bare / 1024:.2f} MiB PSS each",
    }

    print(f"fork into {c.fork}", flush=True)
    src = await b.create(new_id("bench"), local.spec)
    channel = await b.channel(src)
    await channel.exec(["sh", "-c", "mkdir -p /workspace/proj && echo v1 > /workspace/proj/a"])
    await channel.close()
    snap = await b.snapshot(src, new_id("snap"))
    ids = [new_id("fork") for _ in range(c.fork)]
    t = time.perf_counter()
    forks = await b.fork(snap, ids, local.spec)
    fork_s = time.perf_counter() - t
    channel = await b.channel(forks[-1])
    check = await channel.exec(["cat", "/workspace/proj/a"])
    await channel.close()
    assert check.stdout == "v1\n", check
    await local.destroy_all(b, [*forks, src])
    await b.delete_snapshot(snap)
    spawn_s = await anyio.to_thread.run_sync(spawn_many, c.fork, 4)
    table["fork"] = {
        "local": f"{fork_s * 1000:.0f} ms",
        "baseline": f"{c.fork} python3 -I -S starts, 4 at a time: {spawn_s * 1000:.0f} ms",
    }

    print(f"reset x{c.resets}", flush=True)
    ref = await b.create(new_id("bench"), local.spec)
    resets, verify, base = [], [], []
    for i in range(c.resets):
        channel = await b.channel(ref)
        await channel.exec(["sh", "-c", "echo $$ > /workspace/dirty; sleep 60 & true"])
        await channel.close()
        t = time.perf_counter()
        report = await b.reset(ref, None, local.spec)
        resets.append(time.perf_counter() - t)
        assert report["ok"], report
        verify.append(
            float(str(report["duration_ms"]))
            - float(str(report["reset_ms"]))
            - float(str(report["boot_ms"]))
        )
        if i % 10 == 0:
            base.append(await anyio.to_thread.run_sync(timed, bare_python))
    await b.destroy(ref)
    table["reset"] = {
        "local": f"{ms(resets)} (checks {statistics.median(verify):.1f} ms)",
        "baseline": f"python3 -I -S start {ms(base)}",
    }

    print(f"reset from the warm pool x{c.resets}", flush=True)
    pb = local.backend("pool-reset", pool={local.isolation: 1})
    ref = await pb.create(new_id("bench"), local.spec)
    trash = pb.state_dir / ".trash"
    swaps, base = [], []
    async with pb.pool_refiller():
        for i in range(c.resets):
            # Untimed: what the refiller does between two episodes of an agent's work.
            await settled(lambda: bool(pb.pooled(local.isolation)) and not any(trash.iterdir()))
            channel = await pb.channel(ref)
            await channel.exec(["sh", "-c", "echo $$ > /workspace/dirty; sleep 60 & true"])
            await channel.close()
            t = time.perf_counter()
            report = await pb.reset(ref, None, local.spec)
            swaps.append(time.perf_counter() - t)
            assert report["ok"], report
            assert report.get("via") == "pool", report
            if i % 10 == 0:
                base.append(await anyio.to_thread.run_sync(timed, bare_true))
    await pb.destroy(ref)
    table["reset_pool"] = {
        "local": ms(swaps),
        "baseline": f"subprocess.run(['true']) {ms(base)}",
        "docker": "no pool",
    }


async def settled(ready: Callable[[], bool], timeout: float = 120) -> None:
    """Poll until ``ready()`` (the pool refills in the background; there is no event for it)."""
    with anyio.fail_after(timeout):
        while not ready():  # noqa: ASYNC110 - polling a directory, nothing to wait on
            await anyio.sleep(0.005)


def threaded_rate(fn: Callable[[], None], threads: int, seconds: float) -> float:
    count = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def loop() -> None:
        while time.monotonic() < deadline:
            fn()
            with lock:
                count[0] += 1

    t = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(threads):
            pool.submit(loop)
    return count[0] / (time.monotonic() - t)


def spawn_many(n: int, limit: int) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(limit) as pool:
        list(pool.map(lambda _: bare_python(), range(n)))
    return time.perf_counter() - t


def idle_python_pss(n: int) -> float:
    procs = [
        subprocess.Popen(
            [PYTHON, "-I", "-S", "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        for _ in range(n)
    ]
    time.sleep(2)
    try:
        return statistics.mean(pss_kib(p.pid) for p in procs)
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in procs:
            p.wait()


def cgroup_memory_kib(backend: LocalBackend, ref: str) -> float:
    import json

    meta = json.loads((backend.state_dir / ref / "meta.json").read_text())
    rel = f"sandlot/{backend.run_dir.name}/{meta['container']}"
    for path in (
        Path("/sys/fs/cgroup/memory") / rel / "memory.usage_in_bytes",
        Path("/sys/fs/cgroup") / rel / "memory.current",
    ):
        try:
            return int(path.read_text()) / 1024
        except OSError:
            continue
    return 0.0


# ---------------------------------------------------------------------- docker


class Docker:
    def __init__(self, image: str) -> None:
        self.image = image
        self.made: list[str] = []

    @staticmethod
    def engine() -> str | None:
        """The server version when an engine answers, else None."""
        if shutil.which("docker") is None:
            return None
        try:
            proc = subprocess.run(
                ["docker", "version", "--format", "{{.Server.Version}}"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return None
        return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None

    def cli(self, *args: str) -> str:
        proc = subprocess.run(["docker", *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            msg = f"docker {' '.join(args[:3])}: {proc.stderr.strip()}"
            raise RuntimeError(msg)
        return proc.stdout.strip()

    def ensure_image(self) -> None:
        if (
            subprocess.run(
                ["docker", "image", "inspect", self.image], capture_output=True
            ).returncode
            == 0
        ):
            return
        if self.image != DOCKER_IMAGE:
            msg = f"docker image {self.image} is not there"
            raise RuntimeError(msg)
        busybox = shutil.which("busybox")
        if busybox is None:
            msg = "no busybox to build the bench image from (Debian package busybox-static)"
            raise RuntimeError(msg)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for d in ("bin", "tmp", "workspace", "proc", "sys", "dev", "etc"):
                info = tarfile.TarInfo(d)
                info.type = tarfile.DIRTYPE
                info.mode = 0o1777 if d == "tmp" else 0o755
                tar.addfile(info)
            tar.add(busybox, "bin/busybox")
            for applet in ("sh", "true", "sleep", "echo", "cat", "mkdir"):
                info = tarfile.TarInfo(f"bin/{applet}")
                info.type = tarfile.SYMTYPE
                info.linkname = "busybox"
                tar.addfile(info)
        subprocess.run(
            ["docker", "import", "-", self.image],
            input=buf.getvalue(),
            capture_output=True,
            check=True,
        )

    def run(self, image: str | None = None) -> str:
        cid = self.cli("run", "-d", "--network", "none", image or self.image, "sleep", "86400")
        self.made.append(cid)
        return cid

    def rm(self, cids: list[str]) -> None:
        for i in range(0, len(cids), 50):
            subprocess.run(["docker", "rm", "-f", *cids[i : i + 50]], capture_output=True)
        self.made = [c for c in self.made if c not in set(cids)]

    def close(self) -> None:
        self.rm(list(self.made))


def run_docker(c: Counts, d: Docker, table: dict[str, dict[str, str]]) -> None:
    d.ensure_image()
    for _ in range(2):
        d.rm([d.run()])

    print("docker: create -> first exec", flush=True)
    cold = []
    for _ in range(c.docker_cold):
        t = time.perf_counter()
        cid = d.run()
        d.cli("exec", cid, "true")
        cold.append(time.perf_counter() - t)
        d.rm([cid])
    table["cold"]["docker"] = f"{ms(cold)} (n={len(cold)})"
    table["pool"]["docker"] = "no pool"

    print("docker: exec overhead", flush=True)
    cid = d.run()
    execs, base = [], []
    for _ in range(min(c.execs, 200)):
        execs.append(timed(lambda: d.cli("exec", cid, "true")))
        base.append(timed(bare_true))
    over = (statistics.median(execs) - statistics.median(base)) * 1000
    table["exec"]["docker"] = f"+{over:.1f} ms (exec {ms(execs)})"

    print("docker: exec throughput, 10 containers", flush=True)
    cids = [cid, *(d.run() for _ in range(9))]
    it = iter(range(1 << 30))
    lock = threading.Lock()

    def one() -> None:
        with lock:
            target = cids[next(it) % len(cids)]
        d.cli("exec", target, "true")

    rate = threaded_rate(one, 10, c.throughput_s)
    d.rm(cids)
    table["throughput"]["docker"] = f"{rate:.0f} execs/s"

    print(f"docker: memory, {c.docker_idle} idle containers", flush=True)
    with ThreadPoolExecutor(4) as pool:
        cids = list(pool.map(lambda _: d.run(), range(c.docker_idle)))
    time.sleep(3)
    per = []
    for cid in cids:
        pid = int(d.cli("inspect", "-f", "{{.State.Pid}}", cid))
        shim = parent_of(pid)
        per.append(sum(pss_kib(p) for p in descendants(shim)))
    d.rm(cids)
    table["memory"]["docker"] = f"{statistics.mean(per) / 1024:.2f} MiB PSS (n={len(per)}, +shim)"

    print(f"docker: fork into {c.docker_fork}", flush=True)
    src = d.run()
    d.cli("exec", src, "sh", "-c", "mkdir -p /workspace/proj && echo v1 > /workspace/proj/a")
    t = time.perf_counter()
    image = d.cli("commit", src)
    with ThreadPoolExecutor(4) as pool:
        forks = list(pool.map(lambda _: d.run(image), range(c.docker_fork)))
    fork_s = time.perf_counter() - t
    d.rm([*forks, src])
    subprocess.run(["docker", "rmi", "-f", image], capture_output=True)
    table["fork"]["docker"] = f"{fork_s * 1000:.0f} ms (commit + {c.docker_fork} runs)"

    print(f"docker: reset x{c.docker_resets} (rm -f + run)", flush=True)
    cid = d.run()
    resets = []
    for _ in range(c.docker_resets):
        d.cli("exec", cid, "sh", "-c", "echo x > /workspace/dirty")
        t = time.perf_counter()
        d.rm([cid])
        cid = d.run()
        resets.append(time.perf_counter() - t)
    d.rm([cid])
    table["reset"]["docker"] = f"{ms(resets)} (n={len(resets)}, unverified)"


# ---------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, for iterating")
    parser.add_argument("--isolation", default="namespaces", choices=["namespaces", "gvisor"])
    parser.add_argument("--no-docker", action="store_true", help="skip the Docker column")
    parser.add_argument("--docker-image", default=DOCKER_IMAGE)
    parser.add_argument(
        "--no-network-service",
        action="store_true",
        help="sandboxes without the network service (as a bare LocalBackend makes them)",
    )
    parser.add_argument("--resets", type=int, help="override the number of resets")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/local.py needs root (the local backend runs sandboxes as root)")
    c = QUICK if args.quick else FULL
    if args.resets is not None:
        c.resets = args.resets
    rows = ["cold", "pool", "exec", "throughput", "memory", "fork", "reset", "reset_pool"]
    results: dict[str, dict[str, str]] = {r: {} for r in rows}
    load0 = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sandlot-bench-") as tmp:
        local = Local(Path(tmp), args.isolation, networks=not args.no_network_service)

        async def go() -> None:
            try:
                await run_local(c, local, results)
            finally:
                await local.close()

        anyio.run(go)
    engine = None if args.no_docker else Docker.engine()
    if engine is not None:
        docker = Docker(args.docker_image)
        try:
            run_docker(c, docker, results)
        finally:
            docker.close()
    for r in rows:
        if engine is None:
            results[r]["docker"] = "no engine"
        results[r].setdefault("docker", "-")
    targets = {
        "cold": "p50 <= 50 ms, p99 <= 100 ms",
        "pool": "p50 <= 10 ms",
        "exec": "<= 2 ms p50",
        "throughput": "-",
        "memory": "<= 10 MiB",
        "fork": "<= 1000 ms",
        "reset": "p50 <= 50 ms",
        "reset_pool": "p50 <= 50 ms",
    }
    names = {
        "cold": f"create -> first exec, cold (p50 / p99, n={c.cold})",
        "pool": f"create -> first exec, warm pool (n={c.pool})",
        "exec": f"exec overhead of `true` (n={c.execs})",
        "throughput": f"exec throughput, 10 sandboxes ({c.throughput_s:.0f} s)",
        "memory": f"host memory per idle sandbox ({c.idle} running)",
        "fork": f"fork into {c.fork}",
        "reset": f"verified reset, restart (p50 / p99, n={c.resets})",
        "reset_pool": f"verified reset, warm pool (n={c.resets})",
    }
    table = Table()
    print()
    for r in rows:
        res = results[r]
        table.rows.append(
            (names[r], res.get("local", "-"), res.get("baseline", "-"), res["docker"], targets[r])
        )
    load1 = os.getloadavg()
    print(
        f"local backend, isolation={args.isolation}, network service "
        f"{'off' if args.no_network_service else 'on'}; {platform.node()} {platform.release()}, "
        f"{os.cpu_count()} CPUs; load {load0[0]:.2f} -> {load1[0]:.2f}; "
        f"docker {engine or 'no engine'}; {time.monotonic() - started:.0f} s"
    )
    print(table.render())


if __name__ == "__main__":
    main()
