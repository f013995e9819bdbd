"""Working inside a running sandbox: ``exec``, the main process's log, background processes
(start, list, signal, wait, output, stdin) and terminals (PTY).

Each operation resolves its command (:meth:`Session._launch`), passes the gate, wakes a stopped
sandbox (``_ready``) and talks to it over its channel; use counts as activity for idle
timeouts. File operations are in :mod:`sandlot.manager.files`. Must not import a front end.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import final

from sandlot.channel.base import MAIN_LOG, OutputCallback, PtySession, Stdin
from sandlot.errors import ExecFailed, InvalidRequest, NotFound, SandboxError
from sandlot.journal import Intent
from sandlot.manager import tuning
from sandlot.manager.commands import _CountedOutput, command_argv
from sandlot.manager.core import ManagerCore
from sandlot.manager.intents import _fresh, _Replay
from sandlot.models import (
    LOCAL_ACTOR,
    Actor,
    Command,
    ExecResult,
    JsonValue,
    OutputChunk,
    ProcessInfo,
    SandboxInfo,
    utcnow,
)
from sandlot.policy import limits


class Session(ManagerCore):
    """Commands, background processes, terminals and the main log of a running sandbox."""

    async def _launch(
        self,
        sandbox_id: str,
        actor: Actor,
        command: Command | Sequence[str],
        cwd: str | None,
        env: Mapping[str, str] | None,
    ) -> tuple[SandboxInfo, list[str], str, dict[str, str], str | list[str]]:
        """What ``exec``, ``start_process`` and ``open_pty`` start, checked before anything
        reaches the sandbox: its record, the argv, the working directory (the caller's, else
        the command's, else the spec's), the extra environment (the caller's over the
        command's) and the command as policy and receipts show it."""
        if cwd is not None and not cwd.startswith("/"):
            msg = f"cwd must be an absolute path, got {cwd!r}"
            raise InvalidRequest(msg)
        argv, spec_cwd, spec_env = command_argv(command)
        sb = await self._current(sandbox_id, actor)
        workdir = cwd or spec_cwd or sb.spec.workdir
        shown = command if isinstance(command, str) else argv
        extra_env = spec_env | dict(env or {})
        limits.check_env(extra_env)
        return sb, argv, workdir, extra_env, shown

    async def exec(
        self,
        sandbox_id: str,
        command: Command | Sequence[str],
        *,
        actor: Actor = LOCAL_ACTOR,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: Stdin = None,
        on_output: OutputCallback | None = None,
        check: bool = False,
        auto_resume: bool = True,
        idempotency_key: str | None = None,
        collect_output: bool = True,
    ) -> ExecResult:
        """Run a command to completion; output streams to ``on_output`` and is collected
        (``collect_output=False``: only streamed, so output of any size passes in bounded
        memory; the result's ``stdout``/``stderr`` are then empty; under an idempotency key
        the output is always kept, since a repeat returns it).

        ``check=True`` raises ``ExecFailed`` (carrying the result) on a non-zero exit. With an
        ``idempotency_key`` the command runs at most once: a repeat returns the first result
        (its output replayed to ``on_output``), and one whose first attempt died with its
        process reports the outcome as unknown.
        """
        if timeout is not None and timeout <= 0:
            msg = f"timeout must be positive, got {timeout}"
            raise InvalidRequest(msg)
        sb, argv, workdir, extra_env, shown = await self._launch(
            sandbox_id, actor, command, cwd, env
        )
        begun: Intent | _Replay | None = None
        if idempotency_key is not None:
            request: dict[str, JsonValue] = {
                "sandbox_id": sb.id,
                "command": shown if isinstance(shown, str) else list[JsonValue](shown),
                "cwd": workdir,
                "env": dict(extra_env),
                "timeout": timeout,
                "stdin": _stdin_identity(stdin),
            }
            begun = await self._begin_intent(actor, "exec", request, idempotency_key)
            if isinstance(begun, _Replay):
                result = ExecResult.model_validate(begun.result)
                await _replay_output(result, on_output)
                if check and result.exit_code != 0:
                    msg = f"command exited with {result.exit_code}: {' '.join(argv)[:200]}"
                    raise ExecFailed(msg, result)
                return result
        async with self._gated(
            actor, "exec", sb, intent=_fresh(begun), command=shown, cwd=workdir, env=extra_env
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            if outcome.lease is not None:
                journal = self._journal()
                outcome.lease = await self._jr(journal.attach_sandbox, outcome.lease, sb.id)
                # RUNNING before the command is sent: after a crash, an intent found here has
                # an unknown outcome and is never sent again.
                outcome.lease = await self._jr(journal.advance, outcome.lease, "RUNNING")
            channel = await self._channel(sb)
            keep = collect_output or idempotency_key is not None
            counted = _CountedOutput(on_output)
            result = await self._while_active(
                sb,
                channel.exec(
                    argv,
                    cwd=workdir,
                    env=self._env(sb, extra_env),
                    timeout=timeout,
                    stdin=stdin,
                    on_output=counted.feed,
                    collect=keep,
                ),
            )
            outcome.exit_code = result.exit_code
            outcome.output_hash = counted.output_hash()
            outcome.detail = {
                "duration_ms": round(result.duration_ms, 3),
                "timed_out": result.timed_out,
                **counted.summary(),
            }
            outcome.result = result.model_dump(mode="json")
        await self._touch(sb)
        if check and result.exit_code != 0:
            msg = f"command exited with {result.exit_code}: {' '.join(argv)[:200]}"
            raise ExecFailed(msg, result)
        return result

    async def logs(
        self,
        sandbox_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        follow: bool = False,
        offset: int = 0,
        auto_resume: bool = True,
    ) -> AsyncIterator[bytes]:
        """The main process's output log, from byte ``offset``; ``follow`` keeps tailing."""
        sb = await self.get(sandbox_id, actor=actor)
        async with self._gated(actor, "fs.read", sb, path=MAIN_LOG):
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            try:
                async for chunk in channel.follow_file(MAIN_LOG, offset=offset, follow=follow):
                    yield chunk
            except NotFound:
                return

    async def start_process(
        self,
        sandbox_id: str,
        command: Command | Sequence[str],
        *,
        actor: Actor = LOCAL_ACTOR,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> ProcessInfo:
        """Start a program in the background and return at once.

        It belongs to the sandbox, not to the caller: it outlives this call and the caller's
        connection, until it exits, is signalled, or the sandbox stops. Its output is kept
        (the last 8 MiB) for :meth:`process_output`; a ``name`` held by a running process is
        a ``Conflict``.
        """
        if name is not None and not name:
            msg = "a process name must not be empty"
            raise InvalidRequest(msg)
        sb, argv, workdir, extra_env, shown = await self._launch(
            sandbox_id, actor, command, cwd, env
        )
        async with self._gated(
            actor, "process.start", sb, command=shown, cwd=workdir, env=extra_env
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            info = await self._channel_call(
                sb,
                channel.start_process(argv, cwd=workdir, env=self._env(sb, extra_env), name=name),
            )
            outcome.detail = {"process_id": info.id, "pid": info.pid}
        await self._touch(sb)
        return info

    async def list_processes(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> builtins.list[ProcessInfo]:
        """Background processes (the main process among them), running and recently exited,
        in start order."""
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "process.list", sb, process_id="", signal=0) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            processes = await self._channel_call(sb, channel.list_processes())
            outcome.detail = {"processes": len(processes)}
            return processes

    async def signal_process(
        self,
        sandbox_id: str,
        process_id: str,
        signum: int = 15,
        *,
        actor: Actor = LOCAL_ACTOR,
    ) -> None:
        """Send a signal (default SIGTERM) to a background process's whole tree.

        ``InvalidState`` when it already exited; ``NotFound`` for an unknown id.
        """
        self._check_process_id(process_id)
        if not 1 <= signum <= 64:
            msg = f"signal must be a signal number 1..64, got {signum}"
            raise InvalidRequest(msg)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "process.signal", sb, process_id=process_id, signal=signum):
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            await self._channel_call(sb, channel.signal_process(process_id, signum))
        await self._touch(sb)

    async def wait_process(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        timeout: float | None = None,
    ) -> ProcessInfo:
        """Wait until a background process exits and its output is complete; its final
        record. ``SandboxTimeout`` when ``timeout`` seconds pass first (it keeps running)."""
        self._check_process_id(process_id)
        if timeout is not None and timeout <= 0:
            msg = f"timeout must be positive, got {timeout}"
            raise InvalidRequest(msg)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(
            actor, "process.wait", sb, process_id=process_id, signal=0
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            info = await self._channel_call(sb, channel.wait_process(process_id, timeout))
            outcome.exit_code = info.exit_code
            return info

    async def process_output(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        offset: int = 0,
        follow: bool = False,
    ) -> AsyncIterator[OutputChunk]:
        """A background process's output from chunk ``offset`` on; with ``follow``, keep
        yielding until it exits.

        Chunks are numbered (``seq``) across stdout and stderr, so a reader resumes after the
        last one it has. Output older than the sandbox keeps (the last 8 MiB) is gone: the
        first chunk's ``seq`` is then greater than ``offset``.
        """
        self._check_process_id(process_id)
        if offset < 0:
            msg = f"offset must not be negative, got {offset}"
            raise InvalidRequest(msg)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(
            actor, "process.output", sb, process_id=process_id, signal=0
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            sent = 0
            async for chunk in channel.process_output(process_id, offset=offset, follow=follow):
                sent += 1
                yield chunk
            outcome.detail = {"chunks": sent}

    async def write_stdin(
        self,
        sandbox_id: str,
        process_id: str,
        data: bytes,
        *,
        actor: Actor = LOCAL_ACTOR,
        close: bool = False,
    ) -> None:
        """Feed a background process's standard input (then close it, with ``close``).

        Returns once every byte is in the process's stdin pipe. ``InvalidState`` when its
        stdin was closed or it exited.
        """
        self._check_process_id(process_id)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(
            actor, "process.stdin", sb, process_id=process_id, signal=0
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            await self._channel_call(sb, channel.write_stdin(process_id, data, close=close))
            # The receipt records what went in (its hash), as an exec's records its output.
            outcome.output = data
            outcome.detail = {"bytes": len(data), "closed": close}
        await self._touch(sb)

    async def open_pty(
        self,
        sandbox_id: str,
        command: Command | Sequence[str] | None = None,
        *,
        actor: Actor = LOCAL_ACTOR,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> PtySession:
        """Start a program (default ``sh``) on a new terminal inside the sandbox.

        The terminal lives until its program exits or it is closed (``close`` hangs up: the
        program gets SIGHUP). Keystrokes and output count as activity for idle timeouts. What
        is typed into it is not decided by the policy (only opening it is): a policy that must
        see every command denies ``pty.open``.
        """
        for what, n in (("rows", rows), ("cols", cols)):
            if not 1 <= n <= 65535:
                msg = f"{what} must be 1..65535, got {n}"
                raise InvalidRequest(msg)
        sb, argv, workdir, extra_env, shown = await self._launch(
            sandbox_id, actor, ["sh"] if command is None else command, cwd, env
        )
        async with self._gated(
            actor, "pty.open", sb, command=shown, cwd=workdir, env=extra_env
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            session = await self._channel_call(
                sb,
                channel.open_pty(
                    argv, rows=rows, cols=cols, cwd=workdir, env=self._env(sb, extra_env)
                ),
            )
            outcome.detail = {"pty_id": session.id, "rows": rows, "cols": cols}
        await self._touch(sb)
        return _Terminal(self, sb.id, session)

    @staticmethod
    def _check_process_id(process_id: str) -> None:
        if not process_id or len(process_id) > 256 or "\x00" in process_id:
            msg = f"not a process id: {process_id!r}"
            raise InvalidRequest(msg)


async def _replay_output(result: ExecResult, on_output: OutputCallback | None) -> None:
    """A replayed command's recorded output, given to the caller's callback as it was the
    first time (a retry prints what the command printed)."""
    if on_output is None:
        return
    seq = 0
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            maybe = on_output(OutputChunk(seq=seq, stream=stream, data=text.encode()))
            if maybe is not None:
                await maybe
            seq += 1


def _stdin_identity(stdin: Stdin) -> JsonValue:
    """What an idempotency key remembers of a command's input: a hash, or that it streamed."""
    if stdin is None:
        return None
    if isinstance(stdin, bytes):
        return "sha256:" + hashlib.sha256(stdin).hexdigest()
    return "stream"


@final
class _Terminal:
    """A channel's terminal whose use counts as activity, so a sandbox someone is typing
    into (or watching output in) is not stopped as idle."""

    def __init__(self, manager: ManagerCore, sandbox_id: str, session: PtySession) -> None:
        self._manager = manager
        self._sandbox_id = sandbox_id
        self._session = session
        self._touched = time.monotonic()

    @property
    def id(self) -> str:
        return self._session.id

    async def _touch(self) -> None:
        now = time.monotonic()
        if now - self._touched < tuning.TOUCH_EVERY:
            return
        self._touched = now
        # Bookkeeping only: a sandbox gone meanwhile shows in the terminal's own calls.
        with contextlib.suppress(SandboxError):
            await self._manager.store.touch(self._sandbox_id, utcnow())

    async def write(self, data: bytes) -> None:
        await self._session.write(data)
        await self._touch()

    async def resize(self, rows: int, cols: int) -> None:
        for what, n in (("rows", rows), ("cols", cols)):
            if not 1 <= n <= 65535:
                msg = f"{what} must be 1..65535, got {n}"
                raise InvalidRequest(msg)
        await self._session.resize(rows, cols)

    async def read(self) -> bytes:
        data = await self._session.read()
        if data:
            await self._touch()
        return data

    async def wait(self) -> int:
        return await self._session.wait()

    async def close(self) -> None:
        await self._session.close()
