"""Files inside a sandbox: read (whole or streamed), write (bytes, text or streamed chunks),
list, remove.

Each path is decided as written and, when a symlink inside the sandbox leads elsewhere, again as
the sandbox resolves it (:meth:`Files._resolved`); the channel then acts on exactly that path,
following no link. A keyed write remembers its content's hash (a stream is spooled to learn it).
Must not import a front end.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import final

import anyio

from sandlot.channel.base import Channel
from sandlot.errors import InvalidRequest
from sandlot.journal import Intent
from sandlot.manager.core import ManagerCore
from sandlot.manager.intents import _fresh, _Outcome, _Replay
from sandlot.models import LOCAL_ACTOR, Actor, FileInfo, JsonValue, SandboxInfo
from sandlot.policy.normalize import normalize_path

FileBody = bytes | str | AsyncIterable[bytes]
"""What a file write takes: its bytes, text (written as UTF-8), or chunks to stream."""


class Files(ManagerCore):
    """Reading, writing, listing and removing files inside a sandbox."""

    async def read_file(
        self, sandbox_id: str, path: str, *, actor: Actor = LOCAL_ACTOR, auto_resume: bool = True
    ) -> bytes:
        """A whole file's bytes (for large files use :meth:`stream_file`)."""
        return b"".join(
            [
                c
                async for c in self.stream_file(
                    sandbox_id, path, actor=actor, auto_resume=auto_resume
                )
            ]
        )

    async def stream_file(
        self, sandbox_id: str, path: str, *, actor: Actor = LOCAL_ACTOR, auto_resume: bool = True
    ) -> AsyncIterator[bytes]:
        """A file's bytes in chunks."""
        _check_path(path)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "fs.read", sb, path=path) as outcome:
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            digest = hashlib.sha256()
            size = 0
            async with self._resolved(actor, "fs.read", sb, channel, path) as real:
                async for chunk in channel.read_file(real, nofollow=True):
                    digest.update(chunk)
                    size += len(chunk)
                    yield chunk
            outcome.detail = {"sha256": digest.hexdigest(), "size": size}
        await self._touch(sb)

    async def write_files(
        self,
        sandbox_id: str,
        files: Mapping[str, FileBody],
        *,
        actor: Actor = LOCAL_ACTOR,
        mode: int | None = None,
        auto_resume: bool = True,
        idempotency_key: str | None = None,
        digests: Mapping[str, str] | None = None,
    ) -> builtins.list[FileInfo]:
        """Create or replace files (parents are made); strings are written as UTF-8, and an
        async iterable of chunks is streamed (never held whole in memory).

        Each file is decided by the policy on its own. With an ``idempotency_key`` a repeat
        of the same call (same paths and contents) returns the first call's result; a streamed
        body counts by its ``digests`` entry (``sha256:…``, when the caller knows it) or else
        as "a stream".
        """
        for path in files:
            _check_path(path)
        if not files:
            return []
        bodies = {p: d.encode() if isinstance(d, str) else d for p, d in files.items()}
        digests = dict(digests or {})
        spools: list[_Spool] = []
        try:
            if idempotency_key is not None:
                for path, body in bodies.items():
                    if not isinstance(body, bytes) and path not in digests:
                        # A key remembers what was written: a stream is spooled (to disk past
                        # a MiB) to learn its hash first, so the same key with other content is
                        # a Conflict, never a silent replay.
                        spools.append(spool := _Spool())
                        digests[path] = await spool.fill(body)
                        bodies[path] = spool
            return await self._write_files(
                sandbox_id, bodies, actor, mode, auto_resume, idempotency_key, digests
            )
        finally:
            for spool in spools:
                spool.close()

    async def _write_files(
        self,
        sandbox_id: str,
        bodies: dict[str, bytes | AsyncIterable[bytes]],
        actor: Actor,
        mode: int | None,
        auto_resume: bool,
        idempotency_key: str | None,
        digests: Mapping[str, str],
    ) -> builtins.list[FileInfo]:
        sb = await self._current(sandbox_id, actor)
        begun: Intent | _Replay | None = None
        if idempotency_key is not None:
            request: dict[str, JsonValue] = {
                "sandbox_id": sb.id,
                "files": {p: _body_identity(b, digests.get(p)) for p, b in bodies.items()},
                "mode": mode,
            }
            begun = await self._begin_intent(actor, "fs.write", request, idempotency_key)
            if isinstance(begun, _Replay):
                assert isinstance(begun.result, dict)
                files_done = begun.result["files"]
                assert isinstance(files_done, list)
                return [FileInfo.model_validate(f) for f in files_done]
        (first, *rest) = bodies.items()
        infos: builtins.list[FileInfo] = []

        async def write(path: str, body: bytes | AsyncIterable[bytes], outcome: _Outcome) -> None:
            nonlocal sb
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            async with self._resolved(
                actor, "fs.write", sb, channel, path, follow_last=False
            ) as real:
                await write_at(channel, path, real, body, outcome)

        async def write_at(
            channel: Channel,
            path: str,
            real: str,
            body: bytes | AsyncIterable[bytes],
            outcome: _Outcome,
        ) -> None:
            if isinstance(body, bytes):
                info = await self._channel_call(
                    sb, channel.write_file(real, body, mode=mode, nofollow=True)
                )
                infos.append(info.model_copy(update={"path": path}))
                outcome.output = body
                return
            digest = hashlib.sha256()

            async def hashed() -> AsyncIterator[bytes]:
                async for chunk in body:
                    digest.update(chunk)
                    yield chunk

            info = await self._channel_call(
                sb, channel.write_file(real, hashed(), mode=mode, nofollow=True)
            )
            infos.append(info.model_copy(update={"path": path}))
            outcome.output_hash = "sha256:" + digest.hexdigest()

        # The first file's decision also authorizes the intent; the others are decided inside
        # its block, so a later denial fails the call as a whole (and its replays alike).
        async with self._gated(
            actor, "fs.write", sb, intent=_fresh(begun), path=first[0]
        ) as outcome:
            if outcome.lease is not None:
                journal = self._journal()
                outcome.lease = await self._jr(journal.attach_sandbox, outcome.lease, sb.id)
                outcome.lease = await self._jr(journal.advance, outcome.lease, "RUNNING")
            await write(*first, outcome)
            for path, body in rest:
                async with self._gated(actor, "fs.write", sb, path=path) as inner:
                    await write(path, body, inner)
            outcome.result = {"files": [i.model_dump(mode="json") for i in infos]}
        await self._touch(sb)
        return infos

    async def list_files(
        self, sandbox_id: str, path: str, *, actor: Actor = LOCAL_ACTOR, auto_resume: bool = True
    ) -> builtins.list[FileInfo]:
        """A directory's entries."""
        _check_path(path)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "fs.list", sb, path=path) as outcome:
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            async with self._resolved(actor, "fs.list", sb, channel, path) as real:
                entries = await self._channel_call(sb, channel.list_files(real, nofollow=True))
            outcome.detail = {"entries": len(entries)}
            return entries

    async def remove_file(
        self,
        sandbox_id: str,
        path: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        recursive: bool = False,
        auto_resume: bool = True,
    ) -> None:
        """Remove a file (or a tree with ``recursive``)."""
        _check_path(path)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "fs.remove", sb, path=path, recursive=recursive):
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            async with self._resolved(
                actor, "fs.remove", sb, channel, path, follow_last=False, recursive=recursive
            ) as real:
                await self._channel_call(
                    sb, channel.remove(real, recursive=recursive, nofollow=True)
                )

    @contextlib.asynccontextmanager
    async def _resolved(
        self,
        actor: Actor,
        action: str,
        sb: SandboxInfo,
        channel: Channel,
        path: str,
        *,
        follow_last: bool = True,
        recursive: bool = False,
    ) -> AsyncIterator[str]:
        """``path`` as the sandbox resolves it; decided again when symlinks lead elsewhere.

        The gate decided on the path as written, but a link planted inside (``/workspace/e``
        -> ``/etc``) would carry the operation somewhere else, so the resolved path is decided
        too (its receipt names it), and the channel is then told to act on exactly that path,
        following no link (one swapped in after this check fails the operation).
        """
        real = await self._channel_call(sb, channel.resolve(path, follow_last=follow_last))
        if real == normalize_path(path):
            yield real
            return
        async with self._gated(actor, action, sb, path=real, recursive=recursive):
            yield real


@final
class _Spool:
    """A stream's bytes kept (on disk past a MiB) to be streamed again, and their hash."""

    def __init__(self) -> None:
        self.file = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - close()
        self.digest = hashlib.sha256()

    async def fill(self, chunks: AsyncIterable[bytes]) -> str:
        async for chunk in chunks:
            self.digest.update(chunk)
            await anyio.to_thread.run_sync(self.file.write, chunk)
        await anyio.to_thread.run_sync(self.file.seek, 0)
        return "sha256:" + self.digest.hexdigest()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await anyio.to_thread.run_sync(self.file.read, 1 << 20):
            yield chunk

    def close(self) -> None:
        self.file.close()


def _body_identity(body: bytes | AsyncIterable[bytes], digest: str | None) -> str:
    """What an idempotency key remembers of a file's content."""
    if isinstance(body, bytes):
        return "sha256:" + hashlib.sha256(body).hexdigest()
    return digest or "stream"


def _check_path(path: str) -> None:
    if not path.startswith("/"):
        msg = f"path must be absolute, got {path!r}"
        raise InvalidRequest(msg)
    if "\x00" in path:
        msg = "path must not contain NUL bytes"
        raise InvalidRequest(msg)
