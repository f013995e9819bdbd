"""Load test of the HTTP API: N concurrent clients doing create -> exec -> destroy.

Runs the same workload on the in-process SDK and through the HTTP client against a real server
on a loopback port, in the same run, and prints throughput and p50/p99 per operation:

    .venv/bin/python bench/server.py                     # fake backend, 50 clients x 10 rounds
    .venv/bin/python bench/server.py --backend local     # also the local backend, when it works

The server runs in a thread of this process (as ``sandlot serve`` would run it, uvicorn on
its own loop); clients run on the main loop. Numbers are wall-clock milliseconds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from sandlot.client import AsyncClient
from sandlot.sdk import AsyncSandlot
from sandlot.server import ServerConfig
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend

OPS = ("create", "exec", "destroy")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _workload(
    api: AsyncSandlot | AsyncClient, clients: int, rounds: int
) -> tuple[dict[str, list[float]], float]:
    times: dict[str, list[float]] = {op: [] for op in OPS}

    async def timed(op: str, call: Callable[[], Awaitable[object]]) -> object:
        t0 = time.perf_counter()
        result = await call()
        times[op].append((time.perf_counter() - t0) * 1000)
        return result

    async def one_client() -> None:
        for _ in range(rounds):
            sb = await timed("create", api.create)
            result = await timed("exec", lambda sb=sb: sb.exec(["echo", "hi"]))  # type: ignore[attr-defined, misc]
            assert result.stdout == "hi\n"  # type: ignore[attr-defined]
            await timed("destroy", sb.destroy)  # type: ignore[attr-defined]

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(clients):
            tg.start_soon(one_client)
    return times, time.perf_counter() - started


def _row(label: str, times: dict[str, list[float]], wall: float, clients: int, rounds: int) -> str:
    cycles = clients * rounds
    cells = [f"{label:<22}", f"{cycles / wall:8.1f}"]
    cells += [f"{_pct(times[op], 0.5):8.1f} {_pct(times[op], 0.99):8.1f}" for op in OPS]
    return " | ".join(cells)


async def _bench_sdk(
    home: Path, backends: dict[str, object], backend: str, clients: int, rounds: int
) -> str:
    async with AsyncSandlot(home, backend, backends=backends) as sdk:  # type: ignore[arg-type]
        await _workload(sdk, 2, 2)  # warm up: migrations, imports, first channel
        times, wall = await _workload(sdk, clients, rounds)
    return _row(f"in-process SDK ({backend})", times, wall, clients, rounds)


async def _bench_http(
    server: ServerThread, key: str, backend: str, clients: int, rounds: int
) -> str:
    async with AsyncClient(server.url, key) as client:
        await _workload(client, 2, 2)
        times, wall = await _workload(client, clients, rounds)
    return _row(f"HTTP client ({backend})", times, wall, clients, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--backend", action="append", default=[], help="also bench this backend (local)"
    )
    args = parser.parse_args()
    header = " | ".join(
        [f"{'implementation':<22}", "cycles/s"] + [f"{op + ' p50':>8} {'p99':>8}" for op in OPS]
    )
    print(
        f"{args.clients} concurrent clients x {args.rounds} rounds of create -> exec -> destroy (ms)"
    )
    print(header)
    print("-" * len(header))
    for backend in ["fake", *args.backend]:
        backends: dict[str, object] = {"fake": FakeBackend()} if backend == "fake" else {}
        with tempfile.TemporaryDirectory() as tmp:
            try:
                print(
                    anyio.run(
                        _bench_sdk, Path(tmp) / "sdk", backends, backend, args.clients, args.rounds
                    )
                )
            except Exception as e:  # a backend missing on this host is reported, not fatal
                print(f"{'in-process SDK (' + backend + ')':<22} | unavailable: {e}")
                continue
            config = ServerConfig(sweep_interval=None, mcp=False)
            with ServerThread(
                Path(tmp) / "srv", backends=backends or None, config=config, backend=backend
            ) as server:  # type: ignore[arg-type]
                key = server.new_key("bench")
                print(anyio.run(_bench_http, server, key, backend, args.clients, args.rounds))


if __name__ == "__main__":
    main()
