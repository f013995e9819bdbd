"""Commands as the Manager runs them: argv from what a caller wrote, output hashed as it passes.

:func:`command_argv` turns a command string, argv or :class:`~sandlot.models.CommandSpec` into
``(argv, cwd, env)`` within :mod:`sandlot.policy.limits`; :class:`_CountedOutput` hashes and
counts each stream for the execution receipt; :class:`_Tail` keeps the last lines for a death
certificate. Imports models, limits and the channel's types only, nothing of the Manager's rooms.
"""

from __future__ import annotations

import builtins
import hashlib
from collections.abc import Sequence

from sandlot.channel.base import OutputCallback
from sandlot.errors import InvalidRequest
from sandlot.manager import tuning
from sandlot.models import Command, CommandSpec, JsonValue, OutputChunk
from sandlot.policy import limits


def command_argv(command: Command | Sequence[str]) -> tuple[list[str], str | None, dict[str, str]]:
    """A command as ``(argv, cwd, env)``: strings run under ``sh -c``, lists are an argv.

    Raises:
        InvalidRequest: an empty argv, or a command over :mod:`sandlot.policy.limits`.
    """
    if isinstance(command, str):
        limits.check_command(command)
        return ["sh", "-c", command], None, {}
    if isinstance(command, CommandSpec):
        limits.check_argv(command.argv())
        return command.argv(), command.cwd, dict(command.env)
    argv = list(command)
    if not argv:
        msg = "command: an empty argv"
        raise InvalidRequest(msg)
    limits.check_argv(argv)
    return argv, None, {}


class _Tail:
    """Keeps the last lines of a stream of output chunks (for death certificates)."""

    def __init__(self, keep: int = tuning.LAST_LINES) -> None:
        self.keep = keep
        self.buffer = b""

    def feed(self, data: bytes) -> None:
        self.buffer = (self.buffer + data)[-16384:]

    def lines(self) -> builtins.list[str]:
        text = self.buffer.decode(errors="replace")
        return text.splitlines()[-self.keep :]


class _CountedOutput:
    """Hashes and counts each output stream as it passes to the caller's callback: a
    command's receipt says what it printed whether or not the output was kept.

    ``output_hash`` is ``sha256("stdout:<hex>\nstderr:<hex>\n")`` over each stream's raw
    bytes' SHA-256 (``detail.stdout`` / ``detail.stderr`` carry each hash and byte count).
    """

    def __init__(self, on_output: OutputCallback | None) -> None:
        self._on_output = on_output
        self._hashes = {"stdout": hashlib.sha256(), "stderr": hashlib.sha256()}
        self._sizes = {"stdout": 0, "stderr": 0}

    async def feed(self, chunk: OutputChunk) -> None:
        self._hashes[chunk.stream].update(chunk.data)
        self._sizes[chunk.stream] += len(chunk.data)
        if self._on_output is not None:
            result = self._on_output(chunk)
            if result is not None:
                await result

    def summary(self) -> dict[str, JsonValue]:
        return {
            name: {"sha256": "sha256:" + h.hexdigest(), "bytes": self._sizes[name]}
            for name, h in self._hashes.items()
        }

    def output_hash(self) -> str:
        both = "".join(f"{name}:{h.hexdigest()}\n" for name, h in self._hashes.items())
        return "sha256:" + hashlib.sha256(both.encode()).hexdigest()
