"""A real server on a free loopback port (in a thread, on the fake backend), and the SDK and
the HTTP client side by side, so one suite runs against both."""

from __future__ import annotations

import inspect
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from sandlot.client import AsyncClient
from sandlot.models import ExecResult, OutputChunk
from sandlot.sdk import AsyncSandlot
from sandlot.server import ServerConfig
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend, FakeChannel


class ChattyChannel:
    """The fake channel, plus ``chatty N DELAY`` printing ``line i`` N times, DELAY apart."""

    def __init__(self, inner: FakeChannel) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def exec(self, argv, *, on_output=None, **kwargs):  # type: ignore[no-untyped-def]
        if argv[:1] != ["chatty"]:
            return await self._inner.exec(argv, on_output=on_output, **kwargs)
        self._inner._backend._record(self._inner._ref, "exec", argv=list(argv))
        count, delay = int(argv[1]), float(argv[2])
        out = []
        for i in range(count):
            data = f"line {i}\n".encode()
            out.append(data)
            if on_output is not None:
                maybe = on_output(OutputChunk(seq=i, stream="stdout", data=data))
                if inspect.isawaitable(maybe):
                    await maybe
            await anyio.sleep(delay)
        return ExecResult(exit_code=0, stdout=b"".join(out).decode())


class ChattyBackend:
    """A FakeBackend whose channels also stream output over time (``chatty``)."""

    def __init__(self, fake: FakeBackend) -> None:
        self.fake = fake

    def __getattr__(self, name: str) -> object:
        return getattr(self.fake, name)

    @property
    def name(self) -> str:
        return self.fake.name

    async def channel(self, ref: str) -> ChattyChannel:
        return ChattyChannel(await self.fake.channel(ref))


@pytest.fixture(scope="module")
def shared_fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, shared_fake: FakeBackend
) -> Iterator[ServerThread]:
    home = tmp_path_factory.mktemp("server-home")
    config = ServerConfig(sweep_interval=None)
    with ServerThread(home, backends={"fake": ChattyBackend(shared_fake)}, config=config) as s:  # type: ignore[dict-item]
        yield s


@pytest.fixture
def tenant_key(server: ServerThread) -> str:
    """A key for a tenant of its own, so each test sees only its own sandboxes."""
    return server.new_key(f"t-{secrets.token_hex(4)}")


@pytest.fixture(params=["sdk", "client"])
async def api(
    request: pytest.FixtureRequest,
    home: Path,
    server: ServerThread,
    shared_fake: FakeBackend,
    tenant_key: str,
) -> AsyncIterator[tuple[AsyncSandlot | AsyncClient, FakeBackend]]:
    """The in-process SDK or the HTTP client, and the fake backend behind it."""
    shared_fake.exec_handler = None
    if request.param == "sdk":
        fake = FakeBackend()
        async with AsyncSandlot(home, backends={"fake": ChattyBackend(fake)}) as sdk:  # type: ignore[dict-item]
            yield sdk, fake
    else:
        async with AsyncClient(server.url, tenant_key, reconnect_timeout=5) as client:
            yield client, shared_fake
    shared_fake.exec_handler = None
