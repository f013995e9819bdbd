"""Agent benchmarks: exec overhead against a bare subprocess.run, start-up, file throughput.

Run: ``.venv/bin/python bench/agent_exec.py [--n 500] [--mib 256]``. The agent runs as a plain
host process on a unix socket (no isolation), so the numbers are the agent's and the protocol's
own cost. Every baseline is measured in the same run, interleaved with what it is compared to.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from sandlot.channel.client import connect_unix
from sandlot.channel.protocol import (
    AGENT_PATH,
    MAGIC,
    FrameDecoder,
    FrameType,
    encode_frame,
    encode_json,
    prepare_agent,
)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000


def startup(program: Path, n: int) -> list[float]:
    """Seconds from spawning the interpreter to the first exec answered (``--listen-fd``)."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(n):
            path = str(Path(d) / f"s{i}.sock")
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(path)
            listener.listen()
            client = socket.socket(socket.AF_UNIX)
            client.connect(path)
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(program), "--listen-fd", str(listener.fileno())],
                pass_fds=[listener.fileno()],
                start_new_session=True,
            )
            client.sendall(MAGIC + encode_frame(FrameType.HELLO, 0, encode_json({"versions": [1]})))
            client.sendall(
                encode_frame(FrameType.OPEN, 1, encode_json({"op": "exec", "argv": ["true"]}))
            )
            dec = FrameDecoder()
            done = False
            while not done:
                done = any(f.type == FrameType.END for f in dec.feed(client.recv(65536)))
            out.append(time.perf_counter() - t0)
            proc.terminate()
            proc.wait()
            client.close()
            listener.close()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500, help="exec iterations")
    ap.add_argument("--mib", type=int, default=256, help="file size for the throughput run")
    args = ap.parse_args()

    program = prepare_agent(sys.executable)
    rows: list[tuple[str, str, str]] = []

    base = []
    for _ in range(20):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)  # noqa: ASYNC221 - a baseline, nothing else runs
        base.append(time.perf_counter() - t)
    st_py = startup(AGENT_PATH, 20)
    st_pyc = startup(program, 20)
    rows.append(
        ("interpreter start (python -I -S -c pass)", f"{pct(base, 50):.1f}", f"{pct(base, 99):.1f}")
    )
    rows.append(
        ("agent.py start -> first exec answered", f"{pct(st_py, 50):.1f}", f"{pct(st_py, 99):.1f}")
    )
    rows.append(
        (
            "agent.pyc start -> first exec answered",
            f"{pct(st_pyc, 50):.1f}",
            f"{pct(st_pyc, 99):.1f}",
        )
    )

    with tempfile.TemporaryDirectory() as d:
        sock = Path(d) / "agent.sock"
        agent = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is timed
            [sys.executable, "-I", "-S", str(program), "--listen", str(sock)],
            start_new_session=True,
        )
        try:
            ch = await connect_unix(sock)
            for _ in range(50):  # warm up both paths
                await ch.exec(["true"])
                subprocess.run(["true"], check=True)  # noqa: ASYNC221 - the baseline is blocking by definition
            bare: list[float] = []
            via: list[float] = []
            for _ in range(args.n):
                t = time.perf_counter()
                subprocess.run(["true"], check=True)  # noqa: ASYNC221 - the baseline is blocking by definition
                bare.append(time.perf_counter() - t)
                t = time.perf_counter()
                await ch.exec(["true"])
                via.append(time.perf_counter() - t)
            rows.append(
                (
                    "subprocess.run(['true'])  (baseline)",
                    f"{pct(bare, 50):.2f}",
                    f"{pct(bare, 99):.2f}",
                )
            )
            rows.append(("channel.exec(['true'])", f"{pct(via, 50):.2f}", f"{pct(via, 99):.2f}"))
            rows.append(("  overhead (p50 difference)", f"{pct(via, 50) - pct(bare, 50):+.2f}", ""))

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(200):
                    tg.start_soon(ch.exec, ["true"])
            conc = time.perf_counter() - t
            rows.append(("200 concurrent execs of true (total)", f"{conc * 1000:.0f}", ""))

            shm = anyio.Path("/dev/shm")
            target_dir = Path("/dev/shm") if await shm.is_dir() else Path(d)
            for where in (target_dir, Path(d)):
                path = where / f"sandlot-bench-{os.getpid()}.bin"
                blob = os.urandom(1 << 20)

                async def source(b: bytes = blob):
                    for _ in range(args.mib):
                        yield b

                t = time.perf_counter()
                await ch.write_file(str(path), source())
                up = time.perf_counter() - t
                t = time.perf_counter()
                n = 0
                async for chunk in ch.read_file(str(path)):
                    n += len(chunk)
                down = time.perf_counter() - t
                path.unlink()
                size = args.mib << 20
                rows.append(
                    (f"upload {args.mib} MiB to {where} (MB/s)", f"{size / up / 1e6:.0f}", "")
                )
                rows.append(
                    (f"download {args.mib} MiB from {where} (MB/s)", f"{n / down / 1e6:.0f}", "")
                )
            await ch.close()
        finally:
            agent.terminate()
            agent.wait()

    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'p50 ms':>8}  {'p99 ms':>8}")
    for name, p50, p99 in rows:
        print(f"{name:<{width}}  {p50:>8}  {p99:>8}")
    print(
        f"(python {sys.version.split()[0]}, {os.cpu_count()} cpus, n={args.n}; mean overhead "
        f"{(statistics.mean(via) - statistics.mean(bare)) * 1000:+.2f} ms)"
    )


if __name__ == "__main__":
    anyio.run(main)
