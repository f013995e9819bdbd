"""The one place that turns settings into a working Manager, and the parts front ends may open.

:func:`build_manager` assembles, from :class:`~sandlot.settings.Settings`, the store, the signed
receipt log, the policy gate, the intent journal and the backends (with their warm pools), and
returns them as a :class:`Wired`. The in-process SDK, the CLI (through the SDK) and ``sandlot
serve`` all call it, so a setting means the same thing everywhere.

Front ends that need one lower part without a Manager (the receipt and intent commands, ``sandlot
doctor``) open it through the small factories here (:func:`open_receipt_log`,
:func:`open_journal`, :func:`signing_keys`, :func:`database_url`), never by importing the store,
receipts or journal themselves. Warm pools are kept full by :func:`warm_pools` in a long-lived
process (the server) and topped up by :func:`top_up_pools` from a short-lived one (the CLI).

This module is the composition root: it may import anything below the front ends (store,
receipts, journal, gate, policy, the backend registry, the Manager) and must not import a front
end (``cli``, ``server``, ``mcp``, ``sdk``) or a concrete backend (the registry builds those).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, final

import anyio

from sandlot.backends.registry import Backends, default_backend_name
from sandlot.config import default_database_url, receipt_log_id
from sandlot.errors import SandboxError

# The heavy parts (SQLAlchemy, cryptography, Cedar, the Manager) are imported where they are
# built, so a command that only reads a setting or checks a database does not load them.
if TYPE_CHECKING:
    from sandlot.backends.base import Backend
    from sandlot.errors import PolicyDenied
    from sandlot.gate.gate import Approval
    from sandlot.journal import Journal
    from sandlot.manager import Manager
    from sandlot.models import JsonValue
    from sandlot.policy import PolicyConfig
    from sandlot.receipts import KeyStore, Receipt, ReceiptLog
    from sandlot.settings import Settings
    from sandlot.store.sql import SqlStore

__all__ = [
    "Wired",
    "backend_config",
    "build_manager",
    "check_database",
    "database_url",
    "default_backend_name",
    "fill_pools",
    "open_journal",
    "open_receipt_log",
    "open_store",
    "option_defaults",
    "policy_config",
    "redact_url",
    "signing_keys",
    "top_up_pools",
    "warm_pools",
]


@final
@dataclass(frozen=True)
class Wired:
    """What :func:`build_manager` assembled; closing the Manager and the log is the caller's."""

    manager: Manager
    store: SqlStore
    receipts: ReceiptLog
    """The signed receipt log (in the same database as the records)."""
    url: str
    """The database URL the store opened."""


def database_url(database: str | None, home_dir: Path) -> str:
    """A SQLAlchemy URL from a URL, a SQLite file path, or nothing (``$SANDLOT_DATABASE_URL``,
    else the home's SQLite file).

    A bare path must name an existing file or end in ``.db``, ``.sqlite`` or ``.sqlite3`` (so
    a mistyped URL is refused rather than becoming a new file); ``sqlite:///PATH`` takes any.

    Raises:
        InvalidRequest: ``database`` is none of those, or names an unsupported database.
    """
    from sandlot.store.connect import parse_database

    return parse_database(default_database_url(home_dir) if database is None else database)


def check_database(url: str) -> None:
    """Connect to ``url`` and run one query; raise what a user of it would see if that fails."""
    from sandlot.store.connect import check_database as check

    check(url)


def redact_url(url: str) -> str:
    """``url`` with its password shown as ``***`` (for printing where it came from)."""
    from sandlot.store.connect import redact_url as redact

    return redact(url)


def policy_config(
    policy: str | Path | Sequence[str | Path] | PolicyConfig | None,
) -> PolicyConfig:
    """The gate's policy configuration from policy files (one or several), a ready
    configuration, or None (``$SANDLOT_POLICY``, ``:``-separated, else the shipped default)."""
    from sandlot.policy import PolicyConfig

    if isinstance(policy, PolicyConfig):
        return policy
    if policy is None:
        raw = os.environ.get("SANDLOT_POLICY")
        if not raw:
            return PolicyConfig()
        paths: list[str | Path] = list(raw.split(":"))
    elif isinstance(policy, (str, Path)):
        paths = [policy]
    else:
        paths = list(policy)
    return PolicyConfig(policy_paths=tuple(str(p) for p in paths))


def backend_config(settings: Settings) -> dict[str, dict[str, object]]:
    """Each backend's constructor options from the settings (only what differs from its own
    defaults, so an unconfigured backend is built exactly as before)."""
    local = settings.values.backends.local
    pool = {k: v for k, v in local.pool.model_dump().items() if v}
    config: dict[str, dict[str, object]] = {}
    if pool:
        config["local"] = {"pool": pool}
    if settings.values.backends.microvm.pool:
        config["microvm"] = {"pool_size": settings.values.backends.microvm.pool}
    return config


def option_defaults(settings: Settings) -> dict[str, dict[str, JsonValue]]:
    """The backend options a new sandbox gets when its spec leaves them out (only those the
    settings change: a spec without them means what it always meant)."""
    isolation = settings.values.backends.local.isolation
    return {"local": {"isolation": isolation}} if isolation != "namespaces" else {}


def open_store(url: str) -> SqlStore:
    """The record store at ``url``, its schema brought up to date."""
    from sandlot.store.sql import SqlStore

    store = SqlStore(url)
    store.ensure_schema()
    return store


def signing_keys(home_dir: Path) -> KeyStore:
    """The home's receipt-signing keys."""
    from sandlot.receipts import KeyStore

    return KeyStore.default(home_dir)


@contextlib.contextmanager
def open_receipt_log(home_dir: Path, url: str) -> Iterator[ReceiptLog]:
    """This home's receipt log in the database at ``url``, closed (and its connections
    released) on leaving."""
    from sandlot.receipts import ReceiptLog

    store = open_store(url)
    try:
        log = ReceiptLog(
            store.engine, signing_keys(home_dir).active(), log_id=receipt_log_id(home_dir)
        )
        try:
            yield log
        finally:
            log.close()
    finally:
        store.engine.dispose()


@contextlib.contextmanager
def open_journal(url: str) -> Iterator[Journal]:
    """The intent journal in the database at ``url``, its connections released on leaving."""
    from sandlot.journal import Journal, process_owner

    store = open_store(url)
    try:
        yield Journal(store.engine, owner=process_owner())
    finally:
        store.engine.dispose()


def build_manager(
    settings: Settings,
    *,
    backends: Mapping[str, Backend] | None = None,
    policy: str | Path | Sequence[str | Path] | PolicyConfig | None = None,
    hold_timeout: float = 300.0,
    on_deny: Callable[[PolicyDenied], object] | None = None,
    on_receipt: Callable[[Receipt], None] | None = None,
    on_hold: Callable[[Approval], object] | None = None,
) -> Wired:
    """A Manager on the settings' home, database, backends (with their pools) and policy.

    Args:
        settings: The effective settings (:func:`sandlot.settings.load_settings`).
        backends: Backend objects to use instead of the built-in ones, by name (tests pass a
            ``FakeBackend``); a single one given with no backend chosen is the default.
        policy: Overrides the settings' policy files (a path, paths or a configuration).
        hold_timeout: Seconds a HOLD decision waits for an approval before it is a denial.
        on_deny: Called with each ``PolicyDenied`` before it is raised.
        on_receipt: Called with each signed receipt after it is written.
        on_hold: Called with the pending approval when an operation is held.

    Raises:
        InvalidRequest: The policy does not load, the database URL or backend is unknown.
    """
    from sandlot.gate.gate import Gate
    from sandlot.journal import Journal, process_owner
    from sandlot.manager import Manager
    from sandlot.policy import PolicyConfig, load_engine
    from sandlot.receipts import ReceiptLog

    home_dir = settings.home
    name = settings.values.backend
    if name is None and backends is not None and len(backends) == 1:
        # One backend handed in by the caller (a test's FakeBackend) is the default.
        name = next(iter(backends))
    if name is None or name not in (backends or {}):
        name = default_backend_name(name)
    if policy is None and settings.values.policy:
        policy = settings.values.policy
    # First: a policy file that does not load is one clear error, with nothing opened yet.
    engine = load_engine(policy_config(policy if policy is not None else PolicyConfig()))
    url = database_url(settings.values.database, home_dir)
    store = open_store(url)
    receipts = ReceiptLog(
        store.engine, signing_keys(home_dir).active(), log_id=receipt_log_id(home_dir)
    )
    if on_receipt is not None:
        receipts.on_receipt(on_receipt)
    gate = Gate(
        engine,
        receipts,
        store.engine,
        hold_timeout=hold_timeout,
        on_deny=on_deny,
        on_hold=on_hold,
    )
    manager = Manager(
        store,
        Backends(home_dir, extra=backends, config=backend_config(settings)),
        default_backend=name,
        gate=gate,
        journal=Journal(store.engine, owner=process_owner()),
        option_defaults=option_defaults(settings),
    )
    return Wired(manager=manager, store=store, receipts=receipts, url=url)


# -- warm pools --------------------------------------------------------------------------------


def _pooled(manager: Manager) -> list[Backend]:
    """The backends of ``manager`` configured with a warm pool (built now if need be)."""
    backends = manager.backends
    config = backends.config if isinstance(backends, Backends) else {}
    found: list[Backend] = []
    for name in config:
        with contextlib.suppress(KeyError, SandboxError):
            found.append(backends[name])
    return found


async def fill_pools(manager: Manager) -> None:
    """Boot pooled sandboxes until every configured warm pool is full (a backend that cannot
    run here is skipped: its creates would fail the same way)."""
    for backend in _pooled(manager):
        fill = getattr(backend, "fill_pool", None)
        if fill is not None:
            with contextlib.suppress(SandboxError):
                await fill()


@contextlib.asynccontextmanager
async def warm_pools(manager: Manager) -> AsyncIterator[None]:
    """Keep every configured warm pool full while the block runs (a server's lifetime): the
    pools are filled in the background, and a pooled sandbox claimed by a create is replaced.
    """
    async with contextlib.AsyncExitStack() as stack:
        for backend in _pooled(manager):
            refiller = getattr(backend, "pool_refiller", None)
            if refiller is not None:
                await stack.enter_async_context(refiller())
            elif (fill := getattr(backend, "fill_pool", None)) is not None:
                # The microVM backend refills after each claim by itself; it needs the first.
                tg = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(tg.cancel_scope.cancel)
                tg.start_soon(_quietly, fill)
        yield


async def _quietly(fill: Callable[[], Awaitable[object]]) -> None:
    with contextlib.suppress(SandboxError):
        await fill()


def top_up_pools(manager: Manager) -> None:
    """Refill, from a detached process, the local warm pool a short-lived process (a CLI
    command) may have drawn from; nothing when it is full, unconfigured or never built."""
    backends = manager.backends
    if not isinstance(backends, Backends) or "local" not in backends.config:
        return
    local = next((b for b in backends.built() if b.name == "local"), None)
    sizes = getattr(local, "pool_sizes", None)
    pooled = getattr(local, "pooled", None)
    if local is None or sizes is None or pooled is None:
        return
    if all(len(pooled(isolation)) >= size for isolation, size in sizes().items()):
        return
    refill = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandlot.wiring",
            str(backends.home),
            json.dumps({"local": backends.config["local"]}),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
        env={**os.environ, "SANDLOT_HOME": str(backends.home)},
    )
    # Reaped if this process outlives it; a daemon thread never holds up this one's exit
    # (the refill, in its own session, carries on).
    threading.Thread(target=refill.wait, name="sandlot-pool-refill", daemon=True).start()


def _refill_main(home: str, config: str) -> None:
    """``python -m sandlot.wiring HOME CONFIG``: fill the warm pools of the backends in CONFIG
    (JSON: name -> constructor options) once, unless another process is at it already (then
    its fill covers this one's)."""
    lock_path = Path(home) / "backends" / ".pool-refill.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        backends = Backends(Path(home), config=json.loads(config))

        async def fill() -> None:
            for name in backends.config:
                backend = backends[name]
                try:
                    with contextlib.suppress(SandboxError):
                        await backend.fill_pool()  # type: ignore[attr-defined]
                finally:
                    await backend.aclose()

        anyio.run(fill)
    finally:
        os.close(fd)


if __name__ == "__main__":
    _refill_main(sys.argv[1], sys.argv[2])
