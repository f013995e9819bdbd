"""A real sandlot server on a free loopback port, in a background thread (tests, benchmarks).

    with ServerThread(home, backends={"fake": FakeBackend()}) as server:
        key = server.new_key("team-a")
        with Client(server.url, key) as client:
            ...

The server runs uvicorn on its own event loop, on a socket bound before the thread starts,
so its URL is known at once. :meth:`ServerThread.restart` stops it (abruptly, as a crash
would: in-flight streams are cut) and starts a fresh app on the same port and database, to
test what clients do when the server goes away. This module must not import backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self, TypeVar, final

import anyio
import uvicorn

from sandlot.server.app import ServerConfig, create_app
from sandlot.server.keys import ApiKeyStore

if TYPE_CHECKING:
    from fastapi import FastAPI

    from sandlot.backends.base import Backend
    from sandlot.sdk import AsyncSandlot

__all__ = ["ServerThread"]

T = TypeVar("T")


def _blocking(fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``fn`` to completion on a loop of its own (callers may be inside a loop already)."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(anyio.run(fn))
        except BaseException as e:  # handed back to the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="sandlot-server-helper")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]


@final
class ServerThread:
    """``sandlot serve`` in a thread of this process.

    Args:
        home: State directory (the SQLite database lives there unless ``database`` is given).
        backends: Backend objects by name (a ``FakeBackend`` for tests); each is enabled
            for the server's tenants (``ServerConfig.enable_backends``).
        config: Server options.
        database: A database URL instead of the home's SQLite file.
        backend: Default backend name.
        durable_output: Keep exec output in the database, as ``sandlot serve`` does (default:
            in this process's memory).
    """

    def __init__(
        self,
        home: Path,
        *,
        backends: Mapping[str, Backend] | None = None,
        config: ServerConfig | None = None,
        database: str | None = None,
        backend: str | None = None,
        durable_output: bool = False,
    ) -> None:
        from sandlot.sdk import database_url

        self.home = home
        self.backends = backends
        self.config = config or ServerConfig()
        if backends:
            # Backends a test hands in are the ones it means its tenants to use (``fake``
            # among them), as an operator enabling them would.
            enabled = self.config.enable_backends | frozenset(backends)
            self.config = dataclasses.replace(self.config, enable_backends=enabled)
        self.database = database_url(database, home)
        self.backend = backend
        self.durable_output = durable_output
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = ApiKeyStore(self.database)
        self.app: FastAPI | None = None
        self.sdk: AsyncSandlot | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._sock.close()
        _blocking(self.keys.aclose)

    def new_key(self, tenant: str, principal: str | None = None, *, admin: bool = False) -> str:
        """A fresh API key for ``tenant`` (the text, to hand to a client)."""

        async def make() -> str:
            return (await self.keys.create(tenant, principal, admin=admin)).key

        return _blocking(make)

    def start(self) -> None:
        """Start serving (returns once the server accepts connections)."""
        self._error = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"sandlot-server-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not ready.wait(0.01):
            if self._error is not None or not self._thread.is_alive():
                msg = f"the test server did not start: {self._error!r}"
                raise RuntimeError(msg) from self._error
            if time.monotonic() > deadline:
                msg = "the test server did not start within 30s"
                raise RuntimeError(msg)

    def stop(self, *, abrupt: bool = False) -> None:
        """Stop serving; ``abrupt`` cuts open connections at once (as a crash would)."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        if abrupt:
            server.force_exit = True
        thread.join(timeout=30)
        self._server = self._thread = None

    def restart(self) -> None:
        """Stop abruptly and start a new server (new app, same port and database)."""
        self.stop(abrupt=True)
        self.start()

    def _run(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._serve(ready))
        except BaseException as e:  # reported to the thread that waits for start()
            self._error = e

    async def _serve(self, ready: threading.Event) -> None:
        from sandlot.sdk import AsyncSandlot

        sdk = AsyncSandlot(self.home, self.backend, self.database, backends=self.backends)
        self.sdk = sdk
        keys = ApiKeyStore(self.database)
        output = None
        if self.durable_output:
            from sandlot.server.outputlog import DatabaseExecOutputLog

            output = DatabaseExecOutputLog(
                sdk.database_engine,
                retention=self.config.output_retention,
                max_bytes=self.config.output_max_bytes,
            )
        app = create_app(sdk.manager, keys, self.config, output_log=output)
        self.app = app
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=5,
            ws="websockets-sansio",
        )
        server = uvicorn.Server(config)
        self._server = server

        async def announce() -> None:
            while not server.started:  # noqa: ASYNC110 - uvicorn offers only this flag
                await asyncio.sleep(0.005)
            ready.set()

        watcher = asyncio.ensure_future(announce())
        try:
            # uvicorn closes the sockets it served; a duplicate keeps the port ours for a restart.
            await server.serve(sockets=[self._sock.dup()])
        finally:
            watcher.cancel()
            with contextlib.suppress(Exception):
                await keys.aclose()
                await sdk.manager.store.aclose()
