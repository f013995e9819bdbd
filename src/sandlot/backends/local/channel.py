"""The channel the local backend hands out: the agent client plus what only the host knows.

It forwards everything to the agent connection and adds what the agent cannot know on its own:
the sandbox's default environment and working directory from its spec (a sandbox claimed from
the warm pool was booted before its spec was known), the proxy variables of the network policy
in force when each command starts (a policy changes at run time, and the agent's own
environment, which every command inherits, never holds them), and ``ExecResult.oom_killed``,
read from the sandbox's memory cgroup on the host (a counter the sandbox cannot forge). Must
not import the store or the Manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import final

from sandlot.channel.base import Channel, OutputCallback, Stdin
from sandlot.channel.forward import ForwardingChannel
from sandlot.models import ExecResult

__all__ = ["LocalChannel", "read_oom_kills"]


def read_oom_kills(files: list[Path]) -> int:
    """The ``oom_kill`` counter from a cgroup v1 ``memory.oom_control`` or v2 ``memory.events``
    (0 when unreadable)."""
    for path in files:
        with contextlib.suppress(OSError, ValueError):
            for line in path.read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    return 0


@final
class LocalChannel(ForwardingChannel):
    """A :class:`~sandlot.channel.base.Channel` to one local sandbox.

    Args:
        inner: The agent connection (closing this closes it).
        env: Called at each start for the variables every command gets under the caller's.
        workdir: The directory a command starts in when the caller names none.
        oom_files: The memory cgroup files holding the sandbox's OOM-kill counter.
    """

    def __init__(
        self,
        inner: Channel,
        *,
        env: Callable[[], dict[str, str]],
        workdir: str,
        oom_files: Callable[[], list[Path]],
    ) -> None:
        super().__init__(inner)
        self._env = env
        self._workdir = workdir
        self._oom_files = oom_files

    def start_env(self, env: dict[str, str] | None) -> dict[str, str] | None:
        """The spec's environment and the network's proxy variables under the caller's."""
        base = self._env()
        if not base:
            return env
        return {**base, **(env or {})}

    def start_cwd(self, cwd: str | None) -> str | None:
        """The caller's directory, else the spec's workdir."""
        return cwd or self._workdir

    async def exec(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: Stdin = None,
        on_output: OutputCallback | None = None,
        collect: bool = True,
    ) -> ExecResult:
        """Run a command; ``oom_killed`` is set when the memory cgroup killed it."""
        files = self._oom_files()
        before = read_oom_kills(files)
        result = await super().exec(
            argv,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin=stdin,
            on_output=on_output,
            collect=collect,
        )
        if (
            result.signal == 9
            and not result.timed_out
            and not result.oom_killed
            and read_oom_kills(files) > before
        ):
            result = result.model_copy(update={"oom_killed": True})
        return result
