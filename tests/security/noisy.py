"""The noisy-neighbour harness: a real `sandlot serve` (its own process, the `local` backend, two
tenants) and a victim whose latency is measured against its own unloaded baseline in the same run.

    with NoisyServer(tmp_path) as server:
        victim = Victim(server)
        baseline = victim.measure()
        with attack(lambda: flood(server.url, server.key_b)):
            loaded = victim.measure()
        assert_unharmed(baseline, loaded)

A test that uses it names the attack it runs as tenant B; tenant A is the victim, with a running
sandbox of its own. Latencies are wall-clock over HTTP from this process, so the bounds carry a
margin for a busy 2-core host (``max(target, 3 x the victim's own baseline p99)``): a stall of the
server's event loop or worker pool shows as seconds, far past either.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

SANDLOT = [sys.executable, "-m", "sandlot"]
EXEC_P99_MS = 100.0
LIST_P99_MS = 50.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NoisyServer:
    """`sandlot serve` on a free loopback port with a fresh home and keys for tenants a and b."""

    def __init__(self, home: Path, *serve_args: str) -> None:
        self.home = home
        self.serve_args = serve_args
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "SANDLOT_HOME": str(home)}
        self.env.pop("SANDLOT_URL", None)
        self.key_a = self._key("tenant-a")
        self.key_b = self._key("tenant-b")
        self.log = home / "serve.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def _key(self, tenant: str) -> str:
        out = subprocess.run(
            [*SANDLOT, "api-keys", "create", "--tenant", tenant, "--json"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return str(json.loads(out)["key"])

    def __enter__(self) -> NoisyServer:
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                [*SANDLOT, "serve", "--port", str(self.port), *self.serve_args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self._proc.poll() is None, self.log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            time.sleep(0.1)
        msg = f"sandlot serve did not answer in 60 s: {self.log.read_text()}"
        raise AssertionError(msg)

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._proc is not None
        # The sandboxes outlive the server process: destroy both tenants' before it goes, so
        # no container of a test is left running on the host.
        if self._proc.poll() is None:
            for key in (self.key_a, self.key_b):
                with contextlib.suppress(httpx.HTTPError), self.client(key) as http:
                    for sb in http.get("/v1/sandboxes").json():
                        http.delete(f"/v1/sandboxes/{sb['id']}")
        self._proc.terminate()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def client(self, key: str, timeout: float = 60.0) -> httpx.Client:
        """A raw HTTP client for one tenant."""
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )


@dataclass(frozen=True)
class Latencies:
    """One measurement of the victim: p50 and p99 of its exec and its list, in ms."""

    exec_p50: float
    exec_p99: float
    list_p50: float
    list_p99: float


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Victim:
    """Tenant A: a running sandbox, and the two calls whose latency it notices."""

    def __init__(self, server: NoisyServer, rounds: int = 30) -> None:
        self.rounds = rounds
        self.http = server.client(server.key_a, timeout=30)
        made = self.http.post("/v1/sandboxes", json={"spec": {"network": "deny-all"}})
        assert made.status_code in (200, 201), made.text
        self.sandbox_id = made.json()["id"]
        self._exec()  # the first exec warms the sandbox's channel

    def _exec(self) -> None:
        r = self.http.post(
            f"/v1/sandboxes/{self.sandbox_id}/exec",
            json={"command": ["echo", "hi"]},
        )
        assert r.status_code == 200, r.text
        assert r.json()["stdout"] == "hi\n", r.text

    def _list(self) -> None:
        r = self.http.get("/v1/sandboxes")
        assert r.status_code == 200, r.text

    def close(self) -> None:
        self.http.close()

    def measure(self) -> Latencies:
        """p50/p99 of ``exec echo hi`` and of a list, ``rounds`` of each, interleaved.

        A measurement over the targets is taken once more and the better kept: one stray
        pause of a busy 2-core host (a collection, another process's burst) lands in one
        sample of one of them, while a stall an attack causes is in both.
        """
        first = self._sample()
        if first.exec_p99 <= EXEC_P99_MS and first.list_p99 <= LIST_P99_MS:
            return first
        second = self._sample()
        return min(
            first, second, key=lambda m: max(m.exec_p99 / EXEC_P99_MS, m.list_p99 / LIST_P99_MS)
        )

    def _sample(self) -> Latencies:
        execs: list[float] = []
        lists: list[float] = []
        for _ in range(self.rounds):
            for call, into in ((self._exec, execs), (self._list, lists)):
                started = time.perf_counter()
                call()
                into.append((time.perf_counter() - started) * 1000)
        return Latencies(_pct(execs, 0.5), _pct(execs, 0.99), _pct(lists, 0.5), _pct(lists, 0.99))


@contextlib.contextmanager
def attack(step: Callable[[], object], workers: int = 4) -> Iterator[list[BaseException]]:
    """Run ``step`` over and over on ``workers`` threads until the block ends.

    Yields the list of errors the attacker met (an attack that is refused is fine; the list is
    there for tests that expect a refusal).
    """
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                step()
            except Exception as e:  # the attacker's failures are data, not the test's
                errors.append(e)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # let the load build before the victim is measured
    try:
        yield errors
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def assert_unharmed(baseline: Latencies, loaded: Latencies) -> None:
    """The victim's p99s under attack stay within the targets (or 3x its own baseline)."""
    exec_bound = max(EXEC_P99_MS, 3 * baseline.exec_p99)
    list_bound = max(LIST_P99_MS, 3 * baseline.list_p99)
    report = f"baseline {baseline}, under attack {loaded}"
    assert loaded.exec_p99 <= exec_bound, report
    assert loaded.list_p99 <= list_bound, report
