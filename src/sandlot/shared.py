"""Pieces the in-process SDK and the HTTP client share, kept light (no database, no backends).

``build_spec`` turns what a caller passed into a validated spec, ``split_output`` feeds raw
and per-stream text callbacks from output chunks, ``file_body`` turns what a file write was
given into bytes or chunks to stream, and ``EventLoopThread`` runs async twins for the sync
facades.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Mapping,
)
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeVar, final

import anyio
import anyio.to_thread

from sandlot.errors import InvalidRequest
from sandlot.models import OutputChunk, SandboxSpec, parse_model

if TYPE_CHECKING:
    from sandlot.channel.base import OutputCallback

__all__ = ["CHUNK", "Creating", "EventLoopThread", "build_spec", "file_body", "split_output"]

T = TypeVar("T")
H = TypeVar("H", bound="_Destroyable")
CHUNK = 1 << 20
"""Bytes read from a file object at a time when streaming it into a sandbox."""


class _Destroyable(Protocol):
    async def destroy(self) -> object: ...


@final
class Creating(Coroutine[object, object, H]):
    """What an async ``create`` returns: a coroutine (``await`` it, or hand it to
    ``create_task``) that gives the sandbox's handle, which can also be used directly in
    ``async with`` (the sandbox is destroyed on exit), as with the sync SDK's
    ``with client.create() as sb``."""

    def __init__(self, creation: Coroutine[object, object, H]) -> None:
        self._creation = creation
        self._handle: H | None = None

    def __await__(self) -> Generator[object, None, H]:
        return self._creation.__await__()

    def send(self, value: object) -> object:
        return self._creation.send(value)

    def throw(self, *args: Any) -> object:  # noqa: ANN401 - Coroutine.throw's own signature
        return self._creation.throw(*args)

    def close(self) -> None:
        self._creation.close()

    async def __aenter__(self) -> H:
        self._handle = await self._creation
        return self._handle

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            # Shielded: a cancelled body is exactly when the sandbox must still go.
            with anyio.CancelScope(shield=True):
                await self._handle.destroy()


def file_body(
    data: bytes | str | IO[bytes] | Iterable[bytes] | AsyncIterable[bytes],
) -> bytes | AsyncIterator[bytes]:
    """What a file write sends: text as UTF-8 bytes, bytes as they are, and a binary file
    object or an (async) iterable of chunks as a stream, read as it is sent (so a 1 GiB
    upload never sits in memory)."""
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if hasattr(data, "read"):
        return _read_chunks(data)  # type: ignore[arg-type]
    if isinstance(data, AsyncIterable):
        return _checked_chunks(data)
    if isinstance(data, Iterable):
        return _iter_chunks(data)
    msg = f"cannot write a {type(data).__name__}: give bytes, text, a binary file or chunks"
    raise InvalidRequest(msg)


def _chunk(piece: object) -> bytes:
    if isinstance(piece, bytes | bytearray | memoryview):
        return bytes(piece)
    msg = f"a file's chunks must be bytes, got {type(piece).__name__}" + (
        " (open the file in binary mode, 'rb')" if isinstance(piece, str) else ""
    )
    raise InvalidRequest(msg)


async def _read_chunks(source: IO[bytes]) -> AsyncIterator[bytes]:
    while True:
        piece = await anyio.to_thread.run_sync(source.read, CHUNK)
        if not piece:
            return
        yield _chunk(piece)


async def _checked_chunks(source: AsyncIterable[object]) -> AsyncIterator[bytes]:
    async for piece in source:
        yield _chunk(piece)


async def _iter_chunks(source: Iterable[object]) -> AsyncIterator[bytes]:
    pieces = iter(source)
    done = object()
    while True:
        # A generator may block (it reads a file, a socket): not on the event loop.
        piece = await anyio.to_thread.run_sync(next, pieces, done)
        if piece is done:
            return
        yield _chunk(piece)


def build_spec(
    spec: SandboxSpec | Mapping[str, object] | None, fields: Mapping[str, object]
) -> SandboxSpec:
    """A spec from a model or a dict, with keyword fields laid over it, validated."""
    if spec is None:
        base: dict[str, object] = {}
    elif isinstance(spec, SandboxSpec):
        base = spec.model_dump(exclude_unset=True)
        if spec.git is not None and spec.git.auth:
            base["git"] = {**spec.git.model_dump(exclude_unset=True), "auth": spec.git.auth}
    else:
        base = dict(spec)
    return parse_model(SandboxSpec, {**base, **fields})


def split_output(
    on_output: OutputCallback | None,
    on_stdout: Callable[[str], object] | None,
    on_stderr: Callable[[str], object] | None,
) -> OutputCallback | None:
    """One chunk callback feeding the raw callback and per-stream text callbacks.

    Text is decoded incrementally, so a character split across two chunks arrives whole.
    """
    if on_stdout is None and on_stderr is None:
        return on_output
    decoders = {
        "stdout": codecs.getincrementaldecoder("utf-8")(errors="replace"),
        "stderr": codecs.getincrementaldecoder("utf-8")(errors="replace"),
    }
    text_callbacks = {"stdout": on_stdout, "stderr": on_stderr}

    async def callback(chunk: OutputChunk) -> None:
        if on_output is not None:
            result = on_output(chunk)
            if result is not None:
                await result
        text_cb = text_callbacks[chunk.stream]
        if text_cb is not None:
            text = decoders[chunk.stream].decode(chunk.data)
            if text:
                text_cb(text)

    return callback


class EventLoopThread:
    """An asyncio loop on a daemon thread that the sync facades run their async twins on.

    A daemon thread, so a forgotten ``close()`` never hangs interpreter exit.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="sandlot-sdk", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[object, object, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            msg = "the sync SDK was called from one of its own callbacks; use the async SDK there"
            raise RuntimeError(msg)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self.run(_anext(agen))
                except StopAsyncIteration:
                    return
        finally:
            self.run(_aclose(agen))

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


async def _anext(agen: AsyncIterator[T]) -> T:
    return await agen.__anext__()


async def _aclose(agen: AsyncIterator[object]) -> None:
    close = getattr(agen, "aclose", None)
    if close is not None:
        await close()
