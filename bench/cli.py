"""Start-up of the ``sandlot`` command line, as a user's shell runs it: one process per call.

Prints p50/p90 wall-clock milliseconds (and p50 CPU time, steadier on a busy host) of

    sandlot --version          sandlot --help
    sandlot exec ID -- true    embedded (SQLite + local, or fake where local cannot run)
    sandlot exec ID -- true    against `sandlot serve` on a free 127.0.0.1 port (SANDLOT_URL)

next to baselines measured in the same run: ``python -c pass`` with the same interpreter,
the floors the CLI cannot go under (importing typer; a one-command typer app's ``--help``;
importing the SDK and the HTTP client, which ``exec`` needs), and ``docker exec`` when a Docker
engine answers ("no engine" otherwise). Targets (issue 14): --version and --help <= 100 ms,
exec <= 150 ms embedded and <= 120 ms against a server.

    .venv/bin/python bench/cli.py              # 20 runs of each
    .venv/bin/python bench/cli.py --runs 50

Every command runs with bytecode caching on (``PYTHONDONTWRITEBYTECODE`` is dropped from its
environment, and two untimed runs go first), since compiling sources again on each start is
not what an installed CLI does. Each run gets its own state directory, removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PYTHON = sys.executable
_script = Path(PYTHON).parent / "sandlot"
SANDLOT = [str(_script)] if _script.exists() else [PYTHON, "-m", "sandlot"]

# A one-command typer app: the least any typer CLI pays for --help.
TYPER_APP = (
    "import typer\n"
    "app = typer.Typer(add_completion=False)\n"
    "@app.command()\n"
    "def one(x: int = 1) -> None:\n"
    "    '''One.'''\n"
    "app()\n"
)


@dataclass
class Row:
    name: str
    wall: list[float]
    cpu: list[float]
    note: str = ""


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.pop("SANDLOT_URL", None)
    env.update(extra or {})
    return env


def measure(name: str, argv: list[str], runs: int, env: dict[str, str], note: str = "") -> Row:
    """Run ``argv`` ``runs`` times (after two untimed runs); wall and CPU milliseconds."""
    for _ in range(2):
        subprocess.run(argv, env=env, capture_output=True, check=True, timeout=120)
    wall, cpu = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=True, timeout=120)
        wall.append((time.perf_counter() - t0) * 1000)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        cpu.append(used * 1000)
    return Row(name, wall, cpu, note)


def _sandlot(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        [*SANDLOT, *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        msg = f"sandlot {' '.join(args)} failed: {proc.stderr.strip()}"
        raise RuntimeError(msg)
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(home: Path, backend: str) -> Iterator[tuple[str, str]]:
    """``sandlot serve`` on a free loopback port; its URL and an API key for it."""
    env = _env({"SANDLOT_HOME": str(home)})
    key = json.loads(_sandlot(env, "api-keys", "create", "--tenant", "bench", "--json"))["key"]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ["--enable-backend", "fake"] if backend == "fake" else []
    proc = subprocess.Popen(
        [*SANDLOT, "serve", "--host", "127.0.0.1", "--port", str(port), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    msg = f"sandlot serve did not come up: {err.strip()}"
                    raise RuntimeError(msg) from None
                time.sleep(0.2)
        yield url, key
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def embedded_backend(home: Path) -> tuple[str, str]:
    """``local`` when it can make a sandbox on this host, else ``fake`` (and why)."""
    env = _env({"SANDLOT_HOME": str(home)})
    try:
        sid = _sandlot(env, "--backend", "local", "create").strip()
    except RuntimeError as e:
        return "fake", f"local unusable here ({str(e).splitlines()[-1][:60]})"
    _sandlot(env, "destroy", sid)
    return "local", ""


def docker_row(runs: int) -> Row | None:
    """``docker exec CONTAINER true`` on a busybox container, when an engine answers."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    if subprocess.run([docker, "info"], capture_output=True, check=False).returncode != 0:
        return None
    started = subprocess.run(
        [docker, "run", "-d", "--rm", "busybox", "sleep", "3600"],
        capture_output=True,
        text=True,
        check=False,
    )
    if started.returncode != 0:
        return Row("docker exec CONTAINER true", [], [], "engine, but no busybox container")
    cid = started.stdout.strip()
    try:
        return measure("docker exec CONTAINER true", [docker, "exec", cid, "true"], runs, _env())
    finally:
        subprocess.run([docker, "rm", "-f", cid], capture_output=True, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="Timed runs of each command.")
    runs = parser.parse_args().runs
    rows: list[Row] = []
    base = _env()
    rows.append(measure("python -c pass", [PYTHON, "-c", "pass"], runs, base, "baseline"))
    rows.append(measure("python -c 'import typer'", [PYTHON, "-c", "import typer"], runs, base))
    rows.append(
        measure("one-command typer app --help", [PYTHON, "-c", TYPER_APP, "--help"], runs, base)
    )
    rows.append(measure("sandlot --version", [*SANDLOT, "--version"], runs, base, "<= 100 ms"))
    rows.append(measure("sandlot --help", [*SANDLOT, "--help"], runs, base, "<= 100 ms"))
    rows.append(
        measure("python -c 'import sandlot.sdk'", [PYTHON, "-c", "import sandlot.sdk"], runs, base)
    )
    rows.append(
        measure(
            "python -c 'import sandlot.client'", [PYTHON, "-c", "import sandlot.client"], runs, base
        )
    )
    with tempfile.TemporaryDirectory(prefix="sandlot-bench-cli-") as tmp:
        home = Path(tmp) / "embedded"
        backend, why = embedded_backend(home)
        env = _env({"SANDLOT_HOME": str(home), "SANDLOT_BACKEND": backend})
        sid = _sandlot(env, "create").strip()
        try:
            rows.append(
                measure(
                    f"sandlot exec ID -- true (embedded, SQLite + {backend})",
                    [*SANDLOT, "exec", sid, "--", "true"],
                    runs,
                    env,
                    f"<= 150 ms{'; ' + why if why else ''}",
                )
            )
        finally:
            _sandlot(env, "destroy", sid)
        served = Path(tmp) / "server"
        with server(served, backend) as (url, key):
            env = _env({"SANDLOT_URL": url, "SANDLOT_API_KEY": key})
            sid = json.loads(_sandlot(env, "create", "--backend", backend, "--json"))["id"]
            try:
                rows.append(
                    measure(
                        f"sandlot exec ID -- true (SANDLOT_URL, {backend})",
                        [*SANDLOT, "exec", sid, "--", "true"],
                        runs,
                        env,
                        "<= 120 ms",
                    )
                )
            finally:
                _sandlot(env, "destroy", sid)
    docker = docker_row(runs)
    rows.append(docker or Row("docker exec CONTAINER true", [], [], "no engine"))

    baseline = _pct(rows[0].wall, 0.5)
    print(f"{runs} runs each; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    header = f"{'command':<52} {'p50 ms':>8} {'p90 ms':>8} {'cpu p50':>8} {'x pass':>7}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        if not r.wall:
            print(f"{r.name:<52} {'-':>8} {'-':>8} {'-':>8} {'-':>7}  {r.note}")
            continue
        p50 = _pct(r.wall, 0.5)
        print(
            f"{r.name:<52} {p50:8.1f} {_pct(r.wall, 0.9):8.1f} {_pct(r.cpu, 0.5):8.1f} "
            f"{p50 / baseline:7.1f}  {r.note}"
        )


if __name__ == "__main__":
    main()
