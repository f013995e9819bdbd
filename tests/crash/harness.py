"""Crash campaigns against a real ``sandlot serve`` on the ``local`` backend, killed with SIGKILL.

One :class:`CrashSuite` owns a fresh ``SANDLOT_HOME`` and a server subprocess on a free loopback
port. Each run of a scenario (``create``, ``exec``, ``destroy``) fires operations from
concurrent client tasks, some with idempotency keys and some without, sends ``kill -9`` to the
server at a random moment (a seeded RNG picks it), restarts the server on the same home and port
(its start-up marks abandoned exec runs unknown, recovers intents and reconciles; in a quarter
of the runs it is killed a second time while it starts up), retries every keyed operation twice
with its key, and then checks what a user and an operator would notice:

- **orphans**: a backend sandbox (a state directory, a runtime container, a cgroup, a mount, a
  network namespace, a live init) whose record is missing or destroyed; after every live record
  was destroyed at the end of the run, anything at all left of the home's sandboxes; and a
  process of the killed server that outlived it (it would hold its port and locks);
- **double allocations**: two provider allocations for one intent or one deterministic name, or
  two records / backend sandboxes made for one requested create;
- **inconsistent records**: a transitional status left after restart; ``running`` that the
  backend does not see running or that cannot run ``true``; ``stopped``/``failed``/``destroyed``
  without a death certificate; an intent still leased or parked ``NEEDS_RECONCILE``; an
  allocation left open for a destroyed sandbox;
- **wrong replays**: a retried keyed create answering another sandbox (or nothing it made), a
  retried exec or destroy answering something else than the first definitive answer or an
  "outcome unknown", retries disagreeing with each other;
- **re-runs**: a keyed command that ran twice (each command appends one line to a file of its
  own; more than one line is a second run).

Shared by ``tests/crash`` (a few runs per scenario) and ``bench/crash.py`` (the full campaign).
It drives sandlot only through its HTTP client and CLI, and reads the backend's host state
(directories, ``crun list``, cgroups, mounts, namespaces) and the journal tables directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio
import httpx

from sandlot.backends.local import LocalBackend
from sandlot.backends.local.runtime import process_alive
from sandlot.client import AsyncClient
from sandlot.errors import BackendUnavailable, SandboxError
from sandlot.models import JsonValue, SandboxInfo, SandboxStatus
from sandlot.network.service import SandboxNetworks

SCENARIOS = ("create", "exec", "destroy")
COUNTS = ("orphans", "double_allocations", "inconsistent", "wrong_replays", "reruns")
LEASED = ("AUTHORIZED", "ALLOCATING", "ALLOCATED", "RUNNING", "CLEANING")
S = SandboxStatus

# First guesses of how long one scenario's operations take (seconds); each run refines them
# from what it measured, so the kill lands inside the work on a fast or a loaded machine alike.
_PHASE_GUESS = {"create": 1.5, "exec": 0.5, "destroy": 0.6}


_SERVE = (sys.executable, "-m", "sandlot", "serve", "--host", "127.0.0.1", "--no-mcp")


def missing_prerequisite() -> str | None:
    """What this host lacks to run the crash campaign (None: nothing)."""
    if os.geteuid() != 0:
        return "root (the local backend needs user namespaces, mounts and cgroups)"
    for tool, pkg in (
        ("crun", "crun"),
        ("unshare", "util-linux"),
        ("ip", "iproute2"),
        ("nft", "nftables"),
    ):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {pkg})"
    return None


# -- what operations answered ----------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What one attempt of an operation got back."""

    kind: Literal["ok", "error", "unknown", "unsent"]
    """``ok``/``error``: the server answered; ``unknown``: the outcome is unknown (the
    connection broke, or the server says so); ``unsent``: the request never reached a server."""
    value: str = ""
    """For ``ok``: the sandbox id (create), ``exit:stdout`` (exec), ``id:status`` (destroy)."""
    code: str = ""
    outcome: str = ""
    """``details["outcome"]`` of an error (``unknown``, ``not_run``)."""
    sandbox_id: str = ""
    """``details["sandbox_id"]`` of an error, when it names one."""
    message: str = ""

    @property
    def definitive(self) -> bool:
        """Whether this answer says what happened (a result, or an error that is not
        "outcome unknown")."""
        return self.kind == "ok" or (self.kind == "error" and self.outcome != "unknown")

    @property
    def signature(self) -> tuple[str, str]:
        """What two answers about the same operation must agree on."""
        if self.kind == "ok":
            return ("ok", self.value)
        return (self.kind, f"{self.code}/{self.outcome}")

    def __str__(self) -> str:
        if self.kind == "ok":
            return f"ok {self.value!r}"
        extra = f" outcome={self.outcome}" if self.outcome else ""
        return f"{self.kind} {self.code}{extra}: {self.message[:160]}"


def classify(error: BaseException) -> Answer:
    """An exception from the client as an :class:`Answer`."""
    if isinstance(error, SandboxError):
        details = error.details
        outcome = str(details.get("outcome") or "")
        sid = str(details.get("sandbox_id") or details.get("id") or "")
        if isinstance(error, BackendUnavailable) and isinstance(
            error.__cause__, httpx.ConnectError
        ):
            return Answer("unsent", code=error.code, message=error.message)
        if isinstance(error.__cause__, httpx.TimeoutException):
            # The client gave up waiting: the request may still take effect.
            return Answer("unknown", code=error.code, message=error.message)
        kind: Literal["error", "unknown"] = "unknown" if outcome == "unknown" else "error"
        return Answer(kind, code=error.code, outcome=outcome, sandbox_id=sid, message=error.message)
    return Answer("unknown", code=type(error).__name__, message=str(error))


@dataclass
class Op:
    """One operation a client task fires (and, with a key, retries after the restart)."""

    kind: Literal["create", "exec", "destroy"]
    label: str
    key: str | None
    target: str | None = None
    """The sandbox an exec or destroy acts on."""
    spec: dict[str, JsonValue] = field(default_factory=dict)
    stream: bool = False
    """Create with streamed setup output (the server runs it as a detached job)."""
    command: str = ""
    first: Answer | None = None
    """What the attempt before the kill got; None when it was not fired before the kill."""
    retries: list[Answer] = field(default_factory=list)

    def answers(self) -> list[Answer]:
        return [a for a in (self.first, *self.retries) if a is not None]

    def __str__(self) -> str:
        key = f"key={self.key}" if self.key else "no key"
        on = f" on {self.target}" if self.target else ""
        return f"{self.kind} {self.label} ({key}){on}"


@dataclass
class RunReport:
    """The outcome of one crash run: the five counts (each item names what was wrong)."""

    scenario: str
    run: int
    seed: str
    kill_after: float = 0.0
    second_kill: float | None = None
    """Seconds into the restart when the server was killed a second time (during start-up
    and recovery), if it was."""
    ops: int = 0
    in_flight: int = 0
    """Operations whose first attempt had no definitive answer when the server died."""
    recovered: dict[str, int] = field(default_factory=dict)
    """What the restarted server's start-up said it settled."""
    orphans: list[str] = field(default_factory=list)
    double_allocations: list[str] = field(default_factory=list)
    inconsistent: list[str] = field(default_factory=list)
    wrong_replays: list[str] = field(default_factory=list)
    reruns: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    orphan_ids: set[str] = field(default_factory=set)
    """Sandboxes counted as orphans in this run (each is counted once)."""

    def orphan(self, sandbox_id: str, what: str) -> None:
        if sandbox_id not in self.orphan_ids:
            self.orphan_ids.add(sandbox_id)
            self.orphans.append(f"{sandbox_id} {what}")

    def counts(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in COUNTS}

    @property
    def clean(self) -> bool:
        return not any(self.counts().values())

    def describe(self) -> str:
        lines = [
            f"crash run {self.scenario} #{self.run}: seed {self.seed!r} "
            f"(reproduce with SANDLOT_CRASH_SEED={self.seed.split(':')[0]}), "
            f"killed after {self.kill_after:.3f}s"
            + ("" if self.second_kill is None else f" and {self.second_kill:.3f}s into the restart")
            + f", {self.in_flight}/{self.ops} in flight, "
            f"recovered {self.recovered}"
        ]
        lines += [f"  {name}: {item}" for name in COUNTS for item in getattr(self, name)]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- the server process ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``python -m sandlot serve`` on one home and port, as a subprocess of this one."""

    def __init__(self, home: Path, port: int) -> None:
        self.home = home
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = home.parent / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start_seconds = 3.0
        """How long the last start took until /healthz answered."""

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("SANDLOT_DATABASE_URL", "SANDLOT_URL", "SANDLOT_API_KEY")
        }
        env["SANDLOT_HOME"] = str(self.home)
        env["SANDLOT_BACKEND"] = "local"
        return env

    def cli(self, *args: str) -> str:
        """Run a ``sandlot`` CLI command on this home; its standard output."""
        proc = subprocess.run(
            [sys.executable, "-m", "sandlot", *args],
            env=self.env(),
            capture_output=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            msg = f"sandlot {' '.join(args)} failed: {proc.stderr.decode(errors='replace')}"
            raise RuntimeError(msg)
        return proc.stdout.decode()

    def spawn(self) -> None:
        """Start the server without waiting for it."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"\n===== start {self.starts} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv(),
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def start(self, timeout: float = 120.0) -> float:
        """Start the server and wait until ``/healthz`` answers; seconds it took."""
        started = time.monotonic()
        self.spawn()
        assert self.proc is not None
        deadline = started + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                msg = f"sandlot serve exited with {code} while starting:\n{self.tail()}"
                raise RuntimeError(msg)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2.0).status_code == 200:
                    self.start_seconds = time.monotonic() - started
                    return self.start_seconds
            if time.monotonic() > deadline:
                self.kill9()
                msg = f"sandlot serve did not answer /healthz within {timeout:g}s:\n{self.tail()}"
                raise RuntimeError(msg)
            time.sleep(0.05)

    def kill9(self) -> None:
        """``kill -9`` the server (only the process this object started)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop the server the polite way (SIGTERM), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill9()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def argv(self) -> list[str]:
        return [*_SERVE, "--port", str(self.port)]

    def strays(self) -> dict[int, str]:
        """Processes that run this server's command line but are not the server: copies a
        killed server left behind (a fork or clone that never ran another program). They hold
        whatever it held: its listening socket, its locks. ``{pid: state}``."""
        wanted = "\0".join(self.argv()).encode() + b"\0"
        current = self.proc.pid if self.alive() and self.proc is not None else None
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == current:
                continue
            try:
                if (entry / "cmdline").read_bytes() != wanted:
                    continue
                status = (entry / "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            found[int(entry.name)] = (
                f"state {fields.get('State', '?').strip()}, parent {fields.get('PPid', '?').strip()}"
            )
        return found

    def kill_strays(self, settle: float = 1.0) -> dict[int, str]:
        """SIGKILL every stray (each by its pid); the ones found. A child forked to run a
        program carries the command line until it does, for a moment: only a process that
        still has it ``settle`` seconds later counts."""
        found = self.strays()
        if found:
            time.sleep(settle)
            again = self.strays()
            found = {pid: state for pid, state in again.items() if pid in found}
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return found

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def last_recovery(self) -> dict[str, int]:
        """The counts of the last start's ``recovered: …`` line (empty when none)."""
        text = self.log.read_text(errors="replace")
        start = text.rfind("===== start")
        m = re.search(
            r"recovered: (\d+) command\(s\) marked unknown, (\d+) intent\(s\) settled, "
            r"(\d+) record\(s\) updated, (\d+) orphan\(s\) reaped",
            text[start:],
        )
        if m is None:
            return {}
        names = ("unknown_execs", "intents", "records", "reaped")
        return {n: int(v) for n, v in zip(names, m.groups(), strict=True) if int(v)}


# -- what the backend holds on the host ------------------------------------------------------


@dataclass
class Footprint:
    """Everything of one home's local sandboxes on this host, by kind, as sandbox ids."""

    kinds: dict[str, set[str]] = field(default_factory=dict)
    metas: dict[str, dict[str, object]] = field(default_factory=dict)

    def add(self, kind: str, sandbox_id: str) -> None:
        self.kinds.setdefault(kind, set()).add(sandbox_id)

    def ids(self) -> set[str]:
        return set().union(*self.kinds.values()) if self.kinds else set()

    def where(self, sandbox_id: str) -> list[str]:
        return sorted(k for k, ids in self.kinds.items() if sandbox_id in ids)


def _container_id(name: str) -> str:
    return name[3:] if name.startswith("sl-") else name


def _spec_label(meta: dict[str, object]) -> object:
    """The ``crash-op`` label of the spec a backend sandbox's ``meta.json`` records."""
    spec = meta.get("spec")
    labels = spec.get("labels") if isinstance(spec, dict) else None
    return labels.get("crash-op") if isinstance(labels, dict) else None


def _mountpoints() -> list[str]:
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            raw = line.split()[4]
            out.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))
    return out


def _net_tag(sandbox_id: str) -> str:
    return hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]


class Home:
    """The paths of one home's local backend (the places ``backends/local`` writes)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.state_dir = (home / "backends" / "local").absolute()
        self.tag = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]
        self.run_root = Path("/run/sandlot") / self.tag
        self.db = home / "sandlot.db"
        self.networks: SandboxNetworks | None = None

    def backend(self) -> LocalBackend:
        """A backend object on the same state directory: its official view (``list_owned``,
        ``inspect``) and, for leftovers, its ``destroy``.

        Made once, before the server starts, and never closed while it runs: constructing a
        ``LocalBackend`` removes compiled agents it does not recognise from the shared run
        directory (including the server's), and closing one may remove that directory.
        """
        self.networks = SandboxNetworks(self.state_dir / "network")
        return LocalBackend(self.state_dir, networks=self.networks)

    async def scan(self, backend: LocalBackend, known_ids: set[str]) -> Footprint:
        """What is on the host now. ``known_ids`` names sandboxes whose network namespace,
        veth and nftables table (named by a hash of the id) may be looked for."""
        fp = Footprint()
        if self.state_dir.is_dir():
            for entry in self.state_dir.iterdir():
                if entry.name.startswith(".") or entry.name == "network" or not entry.is_dir():
                    continue
                fp.add("directory", entry.name)
                with contextlib.suppress(OSError, ValueError):
                    meta = json.loads((entry / "meta.json").read_text())
                    fp.metas[entry.name] = meta
                    init = meta.get("init")
                    if init and process_alive(int(init[0]), int(init[1])):
                        fp.add("live init", entry.name)
        for runtime in ("crun", "runsc"):
            root = self.run_root / runtime
            if root.is_dir():
                for entry in root.iterdir():
                    if entry.is_dir():
                        fp.add(f"{runtime} state", _container_id(entry.name))
        crun_root = self.run_root / "crun"
        if crun_root.is_dir():
            listed = subprocess.run(
                ["crun", "--root", str(crun_root), "list"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            for line in listed.stdout.splitlines()[1:]:
                if line.split():
                    fp.add("crun list", _container_id(line.split()[0]))
        cgroup = Path("/sys/fs/cgroup")
        for root in [cgroup, *(p for p in cgroup.iterdir() if p.is_dir() and not p.is_symlink())]:
            base = root / "sandlot" / self.tag
            if base.is_dir():
                for entry in base.iterdir():
                    if entry.is_dir():
                        fp.add("cgroup", _container_id(entry.name))
        for mp in _mountpoints():
            for prefix in (f"{self.run_root}/mnt/", f"{self.state_dir}/"):
                if mp.startswith(prefix):
                    fp.add("mount", _container_id(mp[len(prefix) :].split("/")[0]))
        net_state = self.state_dir / "network" / "sandboxes"
        if net_state.is_dir():
            for entry in net_state.glob("*.json"):
                fp.add("network state", entry.stem)
        ids = known_ids | fp.ids()
        netns = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.split()
        links = subprocess.run(
            ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        tables = subprocess.run(
            ["nft", "list", "tables"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        for sid in ids:
            if f"sandlot-{sid}" in netns:
                fp.add("netns", sid)
            if f"slh{_net_tag(sid)}" in links:
                fp.add("veth", sid)
            if f"sandlot_{_net_tag(sid)}" in tables:
                fp.add("nft table", sid)
        for sid in await backend.list_owned():
            fp.add("list_owned", sid)
        return fp

    def uid_ranges(self) -> list[str]:
        """Host uid ranges the registry still records for this state directory."""
        registry = Path("/var/lib/sandlot/uid-ranges")
        out = []
        if registry.is_dir():
            for entry in registry.iterdir():
                with contextlib.suppress(OSError):
                    lines = entry.read_text().splitlines()
                    if lines and lines[0] == str(self.state_dir):
                        out.append(f"{entry.name} ({lines[1] if len(lines) > 1 else '?'})")
        return out

    @contextlib.contextmanager
    def journal(self) -> Iterator[sqlite3.Connection]:
        """The home's database, read-only."""
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
        try:
            yield conn
        finally:
            conn.close()


# -- the campaign ----------------------------------------------------------------------------


class CrashSuite:
    """A home, a server, and crash runs on them.

    Args:
        root: An empty directory for the home and the server log.
        seed: The campaign's seed; run ``n`` of scenario ``s`` uses ``f"{seed}:{s}:{n}"``.
        kill_window: Seconds after which the kill may land at the latest, per scenario
            (default: learnt from each run's measured duration of the operations).
    """

    def __init__(
        self, root: Path, *, seed: str, kill_window: dict[str, float] | None = None
    ) -> None:
        self.root = root
        self.seed = seed
        self.home = Home(root / "home")
        self.server = Server(self.home.home, free_port())
        self.phase = dict(_PHASE_GUESS)
        self.fixed_window = dict(kill_window or {})
        self.admin_key = ""
        self.key = ""
        self.started = False
        self.backend: LocalBackend | None = None

    # -- set-up and tear-down ------------------------------------------------------------------

    def start(self) -> None:
        """Make the API keys (an admin one first) and start the server."""
        self.home.home.mkdir(parents=True, exist_ok=True)
        admin = json.loads(
            self.server.cli("api-keys", "create", "--tenant", "crash", "--admin", "--json")
        )
        self.admin_key = str(admin["key"])
        user = json.loads(self.server.cli("api-keys", "create", "--tenant", "crash", "--json"))
        self.key = str(user["key"])
        self.backend = self.home.backend()
        self.server.start()
        self.started = True

    def close(self) -> list[str]:
        """Stop the server and remove everything of the home's sandboxes from the host; what
        had to be removed without the server (should be nothing)."""
        leftovers: list[str] = []
        if self.started and self.server.alive():
            with contextlib.suppress(Exception):
                anyio.run(self._destroy_all)
        self.server.stop()
        leftovers += [
            f"process {pid} ({state})" for pid, state in self.server.kill_strays().items()
        ]
        if self.home.state_dir.is_dir():
            leftovers += anyio.run(self._force_clean)
        return leftovers

    async def _force_clean(self) -> list[str]:
        backend = self.backend or self.home.backend()
        found = sorted(await backend.list_owned())
        await self._remove(backend, found)
        # The backend removes its host run directory when nothing is left in it.
        await backend.aclose()
        return found

    async def _remove(self, backend: LocalBackend, sandbox_ids: list[str]) -> None:
        """Remove sandboxes from the host behind the server's back (leftovers only)."""
        for sid in sandbox_ids:
            with contextlib.suppress(SandboxError, OSError):
                await backend.destroy(sid)
            if self.home.networks is not None:
                with contextlib.suppress(SandboxError, OSError):
                    await self.home.networks.teardown(sid)

    # -- one run ------------------------------------------------------------------------------

    def run(self, scenario: str, run: int) -> RunReport:
        """One crash run of ``scenario`` (blocking)."""
        if scenario not in SCENARIOS:
            msg = f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})"
            raise ValueError(msg)
        try:
            return anyio.run(self._run, scenario, run)
        except BaseException as e:
            # A run the harness could not finish may leave the server and the host in any
            # state: the next run starts from a fresh server and a clean host.
            self.server.kill9()
            self.server.kill_strays()
            if isinstance(e, Exception):
                with contextlib.suppress(Exception):
                    self._reset()
            raise

    def _reset(self) -> None:
        """A fresh server, every live record destroyed, whatever is left on the host removed."""
        self.server.start()
        anyio.run(self._destroy_all)
        anyio.run(self._remove_leftovers)

    async def _remove_leftovers(self) -> list[str]:
        """Remove (behind the server's back) what is left on the host of sandboxes whose
        record is missing or destroyed; their ids."""
        assert self.backend is not None
        async with AsyncClient(self.server.url, self.admin_key, timeout=60) as admin:
            records = await self._records(admin)
        footprint = await self.home.scan(self.backend, set(records))
        left = sorted(
            sid
            for sid in footprint.ids()
            if sid not in records or records[sid].status is S.DESTROYED
        )
        await self._remove(self.backend, left)
        return left

    async def _run(self, scenario: str, run: int) -> RunReport:
        started = time.monotonic()
        seed = f"{self.seed}:{scenario}:{run}"
        rng = random.Random(seed)
        report = RunReport(scenario, run, seed)
        if not self.server.alive():
            self.server.start()
        tag = f"{scenario[0]}{run}-{secrets.token_hex(3)}"
        async with (
            AsyncClient(self.server.url, self.key, timeout=30, reconnect_timeout=0.3) as client,
            AsyncClient(self.server.url, self.admin_key, timeout=60) as admin,
        ):
            groups = await self._prepare(scenario, client, rng, tag)
            ops = [op for group in groups for op in group]
            report.ops = len(ops)
            window = self.fixed_window.get(scenario) or self.phase[scenario] * 1.25
            report.kill_after = rng.uniform(0.0, window)
            took = await self._fire(client, groups, report.kill_after, report)
            if took is not None and scenario not in self.fixed_window:
                # The operations finished before the kill: learn how long they take.
                self.phase[scenario] = 0.7 * self.phase[scenario] + 0.3 * took
            report.in_flight = sum(
                1 for op in ops if op.first is not None and not op.first.definitive
            )
            if rng.random() < 0.25:
                # A second crash, while the restarted server starts up and recovers.
                report.second_kill = rng.uniform(0.5, 1.05) * self.server.start_seconds
                self.server.spawn()
                await anyio.sleep(report.second_kill)
                self.server.kill9()
                self._strays(report)
            self.server.start()
            report.recovered = self.server.last_recovery()
            await self._retry(client, groups)
            await self._check(admin, groups, tag, report)
            for problem in await self._destroy_all(admin):
                report.inconsistent.append(problem)
            await self._check_clean(admin, report)
        report.seconds = time.monotonic() - started
        return report

    def _strays(self, report: RunReport) -> None:
        for pid, state in self.server.kill_strays().items():
            # Left alone, it keeps the port (no restart) and the backend's locks.
            report.orphans.append(f"process {pid} outlived the killed server ({state})")

    async def _prepare(
        self, scenario: str, client: AsyncClient, rng: random.Random, tag: str
    ) -> list[list[Op]]:
        """The operations of one run, grouped by the client task that fires them in order.
        Sandboxes that execs and destroys act on are made here, before the kill phase."""
        n = 0

        def label() -> str:
            nonlocal n
            n += 1
            return f"{tag}-{n}"

        def key(lab: str) -> str | None:
            return f"k-{lab}" if rng.random() < 0.6 else None

        if scenario == "create":
            groups = []
            for _ in range(3):
                group = []
                for _ in range(2):
                    lab = label()
                    k = key(lab)
                    spec: dict[str, JsonValue] = {
                        "network": rng.choice(["deny-all", "deny-all", "allow-all"]),
                        "labels": {"crash-run": tag, "crash-op": lab},
                    }
                    shape = rng.random()
                    if shape < 0.3:
                        spec["setup"] = [
                            "echo one > /workspace/setup.log",
                            "echo two >> /workspace/setup.log",
                        ]
                    elif shape < 0.5:
                        spec["start"] = "sleep 3600"
                    stream = "setup" in spec and rng.random() < 0.5
                    group.append(Op("create", lab, k, spec=spec, stream=stream))
                groups.append(group)
            return groups
        if scenario == "exec":
            targets = []
            for _ in range(2):
                sb = await client.create(
                    network="deny-all", labels={"crash-run": tag, "crash-op": label()}
                )
                targets.append(sb.id)
            groups = []
            for _ in range(4):
                group = []
                for _ in range(2):
                    lab = label()
                    pause = rng.choice(["0", "0", "0.05", "0.2"])
                    command = (
                        f"mkdir -p /workspace/crash && echo run >> /workspace/crash/{lab} "
                        f"&& sleep {pause} && wc -l < /workspace/crash/{lab}"
                    )
                    group.append(
                        Op("exec", lab, key(lab), target=rng.choice(targets), command=command)
                    )
                groups.append(group)
            return groups
        targets = []
        for _ in range(6):
            sb = await client.create(
                network="deny-all", labels={"crash-run": tag, "crash-op": label()}
            )
            targets.append(sb.id)
        rng.shuffle(targets)
        groups = []
        for i in range(0, len(targets), 2):
            group = []
            for t in targets[i : i + 2]:
                lab = label()
                group.append(Op("destroy", lab, key(lab), target=t))
            groups.append(group)
        return groups

    async def _attempt(self, client: AsyncClient, op: Op) -> Answer:
        try:
            if op.kind == "create":
                output = (lambda chunk: None) if op.stream else None
                sb = await client.create(op.spec, idempotency_key=op.key, on_setup_output=output)
                return Answer("ok", sb.id)
            assert op.target is not None
            handle = await client.get(op.target)
            if op.kind == "exec":
                result = await handle.exec(op.command, idempotency_key=op.key)
                return Answer("ok", f"{result.exit_code}:{result.stdout.strip()}")
            info = await handle.destroy(idempotency_key=op.key)
            return Answer("ok", f"{info.id}:{info.status}")
        except Exception as e:  # every failure is data here
            return classify(e)

    async def _fire(
        self, client: AsyncClient, groups: list[list[Op]], kill_after: float, report: RunReport
    ) -> float | None:
        """Run the groups concurrently and kill the server after ``kill_after`` seconds; how
        long the operations took when they all finished before the kill (else None)."""
        dead = anyio.Event()
        finished: list[float] = []
        t0 = time.monotonic()

        async def task(ops: list[Op]) -> None:
            for op in ops:
                if dead.is_set():
                    return
                op.first = await self._attempt(client, op)
                if dead.is_set():
                    # Cut by the kill: how long it took says nothing about the operations.
                    return
            finished.append(time.monotonic() - t0)

        async with anyio.create_task_group() as tg:
            for ops in groups:
                tg.start_soon(task, ops)
            await anyio.sleep(kill_after)
            self.server.kill9()
            dead.set()
            # While the tasks wait: a process that outlived the server holds its connections
            # open, and they would wait for their timeout.
            await anyio.to_thread.run_sync(self._strays, report)
        return max(finished) if len(finished) == len(groups) else None

    async def _retry(self, client: AsyncClient, groups: list[list[Op]]) -> None:
        """Retry every keyed operation twice: once all at once, once one by one."""
        keyed = [op for ops in groups for op in ops if op.key is not None]

        async def one(op: Op) -> None:
            op.retries.append(await self._attempt(client, op))

        async with anyio.create_task_group() as tg:
            for op in keyed:
                tg.start_soon(one, op)
        for op in keyed:
            await one(op)
        for op in keyed:
            for answer in op.retries:
                if answer.kind == "unsent":
                    msg = f"the restarted server did not answer a retry of {op}: {answer}"
                    raise RuntimeError(msg)

    # -- the invariants -----------------------------------------------------------------------

    async def _records(self, admin: AsyncClient) -> dict[str, SandboxInfo]:
        return {r.id: r for r in await admin.list(include_destroyed=True)}

    async def _check(
        self, admin: AsyncClient, groups: list[list[Op]], tag: str, report: RunReport
    ) -> None:
        ops = [op for g in groups for op in g]
        records = await self._records(admin)
        assert self.backend is not None
        footprint = await self.home.scan(self.backend, set(records))
        # Orphans: something on the host whose record is missing or destroyed.
        for sid in sorted(footprint.ids()):
            rec = records.get(sid)
            if rec is None or rec.status is S.DESTROYED:
                state = "no record" if rec is None else "record destroyed"
                report.orphan(sid, f"({state}) still has: {', '.join(footprint.where(sid))}")
        # Double allocations: in the journal, and per requested create.
        with self.home.journal() as db:
            for intent, count in db.execute(
                "SELECT intent_id, COUNT(*) FROM provider_allocations GROUP BY intent_id HAVING COUNT(*) > 1"
            ):
                report.double_allocations.append(f"intent {intent} has {count} allocations")
            for name, count in db.execute(
                "SELECT deterministic_name, COUNT(*) FROM provider_allocations "
                "GROUP BY deterministic_name HAVING COUNT(*) > 1"
            ):
                report.double_allocations.append(f"name {name} is allocated {count} times")
            intents = db.execute(
                "SELECT intent_id, op, state, lease_owner, error FROM intents WHERE state IN "
                f"({','.join('?' * len(LEASED))}, 'NEEDS_RECONCILE')",
                LEASED,
            ).fetchall()
            open_allocations = db.execute(
                "SELECT intent_id, provider_ref FROM provider_allocations "
                "WHERE provider_ref IS NOT NULL AND released_at IS NULL"
            ).fetchall()
        for op in ops:
            if op.kind != "create":
                continue
            made = [r.id for r in records.values() if r.labels.get("crash-op") == op.label]
            if len(made) > 1:
                report.double_allocations.append(f"{op} made records {made}")
            backend_made = [
                sid for sid, meta in footprint.metas.items() if _spec_label(meta) == op.label
            ]
            if len(backend_made) > 1:
                report.double_allocations.append(f"{op} made backend sandboxes {backend_made}")
        # Consistency of records (every one not destroyed before this run, and this run's).
        backend = self.backend
        for rec in records.values():
            if rec.status is S.DESTROYED and rec.labels.get("crash-run") != tag:
                continue
            problem = await self._record_problem(admin, backend, rec)
            if problem:
                report.inconsistent.append(f"{rec.id} ({rec.status}): {problem}")
        for intent_id, op_name, state, owner, error in intents:
            report.inconsistent.append(
                f"intent {intent_id[:19]}… ({op_name}) left {state} (owner {owner}): {error or ''}"[
                    :300
                ]
            )
        for intent_id, ref in open_allocations:
            rec = records.get(ref)
            if rec is not None and rec.status is S.DESTROYED:
                report.inconsistent.append(
                    f"allocation of intent {intent_id[:19]}… still open for destroyed {ref}"
                )
        # Replays and re-runs.
        for op in ops:
            if op.key is not None:
                problem = self._replay_problem(op, records)
                if problem:
                    report.wrong_replays.append(
                        f"{op}: {problem}; answers: {'; '.join(map(str, op.answers()))}"
                    )
        await self._count_runs(admin, [op for op in ops if op.kind == "exec"], records, report)

    async def _record_problem(
        self, admin: AsyncClient, backend: LocalBackend, rec: SandboxInfo
    ) -> str | None:
        if rec.status.transitional:
            return "left in a transitional status after restart, recover and reconcile"
        if rec.status in (S.STOPPED, S.FAILED, S.DESTROYED) and rec.death is None:
            return "no death certificate"
        if rec.status is S.RUNNING:
            if rec.backend_ref is None:
                return "running without a backend sandbox"
            state = await backend.inspect(rec.backend_ref)
            if state.state != "running":
                return f"the backend says {state.state} ({state.reason})"
            try:
                result = await (await admin.get(rec.id)).exec(["true"], timeout=30)
            except SandboxError as e:
                return f"cannot run a command: {e}"
            if result.exit_code != 0:
                return f"`true` exited {result.exit_code}"
        return None

    def _replay_problem(self, op: Op, records: dict[str, SandboxInfo]) -> str | None:
        answers = op.answers()
        if len(op.retries) != 2:
            return "not retried twice"
        if op.retries[0].signature != op.retries[1].signature:
            return "the two retries disagree"
        definitive = {a.signature for a in answers if a.definitive}
        if len(definitive) > 1:
            return "definitive answers disagree"
        retry = op.retries[-1]
        if op.kind == "create":
            made = sorted(r.id for r in records.values() if r.labels.get("crash-op") == op.label)
            if retry.kind == "ok":
                return (
                    None
                    if made == [retry.value]
                    else f"answered {retry.value}, records made: {made}"
                )
            if made and retry.sandbox_id != made[0]:
                return f"an error that does not name the sandbox it made ({made})"
            if not made and retry.outcome not in ("not_run", ""):
                return "nothing was made, yet the outcome is not 'not run'"
            return None
        if op.kind == "exec":
            if retry.kind == "ok":
                return (
                    None if retry.value == "0:1" else f"the first run printed 1, this {retry.value}"
                )
            if retry.code == BackendUnavailable.code and retry.outcome in ("unknown", "not_run"):
                return None
            return "neither the first result nor 'outcome unknown'"
        if retry.kind == "ok":
            return (
                None if retry.value == f"{op.target}:{S.DESTROYED}" else "not the destroyed record"
            )
        first = op.first
        if first is not None and first.definitive and first.signature == retry.signature:
            return None
        return "a destroy retried after a crash must answer the destroyed record"

    async def _count_runs(
        self, admin: AsyncClient, ops: list[Op], records: dict[str, SandboxInfo], report: RunReport
    ) -> None:
        by_target: dict[str, list[Op]] = {}
        for op in ops:
            assert op.target is not None
            by_target.setdefault(op.target, []).append(op)
        for target, group in by_target.items():
            if records[target].status is not S.RUNNING:
                report.inconsistent.append(f"{target}: not running, its command log cannot be read")
                continue
            files = " ".join(f"/workspace/crash/{op.label}" for op in group)
            script = f"for f in {files}; do if [ -f $f ]; then wc -l < $f; else echo 0; fi; done"
            result = await (await admin.get(target)).exec(script, timeout=30)
            counts = [int(x) for x in result.stdout.split()]
            for op, count in zip(group, counts, strict=True):
                answers = op.answers()
                if count > 1:
                    report.reruns.append(f"{op} ran {count} times")
                elif count == 0 and any(a.kind == "ok" for a in answers):
                    report.inconsistent.append(f"{op} answered a result but never ran")
                elif count == 1 and any(a.outcome == "not_run" for a in answers):
                    report.wrong_replays.append(f"{op} ran, yet was reported 'not run'")

    async def _destroy_all(self, admin: AsyncClient | None = None) -> list[str]:
        """Destroy every live record (plain destroys, no keys); the ones that failed."""
        if admin is None:
            async with AsyncClient(self.server.url, self.admin_key, timeout=60) as a:
                return await self._destroy_all(a)
        failed = []
        for rec in await admin.list():
            try:
                await (await admin.get(rec.id)).destroy()
            except SandboxError as e:
                failed.append(f"destroying {rec.id} ({rec.status}) failed: {e}")
        return failed

    async def _check_clean(self, admin: AsyncClient, report: RunReport) -> None:
        """After everything was destroyed: nothing of the home's sandboxes may remain."""
        records = await self._records(admin)
        live = [r.id for r in records.values() if r.status is not S.DESTROYED]
        if live:
            report.inconsistent.append(f"not destroyed by destroy: {live}")
        assert self.backend is not None
        footprint = await self.home.scan(self.backend, set(records))
        left = sorted(footprint.ids())
        for sid in left:
            report.orphan(
                sid, f"left after destroying everything: {', '.join(footprint.where(sid))}"
            )
        if left:
            # Counted once: the next run starts from a clean host.
            await self._remove(self.backend, left)
        ranges = self.home.uid_ranges()
        if ranges:
            report.notes.append(f"uid ranges still recorded: {ranges}")
