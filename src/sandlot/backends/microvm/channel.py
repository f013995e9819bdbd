"""The channel the microvm backend hands out for a VM with a network: the agent connection plus
the egress proxy's environment.

The guest agent's default environment is fixed when the template boots, before any sandbox's
policy is known, so the proxy variables (``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``/
``NO_PROXY`` in both cases) are added to every command, background process and terminal started
through this channel. They are read per start, so a policy change at run time applies to
commands started after it; the caller's own variables win. Must not import the store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

from sandlot.channel.base import Channel
from sandlot.channel.forward import ForwardingChannel

__all__ = ["NetworkEnvChannel"]


@final
class NetworkEnvChannel(ForwardingChannel):
    """A :class:`~sandlot.channel.base.Channel` that adds the network's environment to what it
    starts and forwards everything else unchanged.

    Args:
        inner: The agent connection (shared: closing this closes it).
        env: Called at each start for the variables to add (empty: none).
    """

    def __init__(self, inner: Channel, env: Callable[[], dict[str, str]]) -> None:
        super().__init__(inner)
        self._env = env

    def start_env(self, env: dict[str, str] | None) -> dict[str, str] | None:
        """The network's variables under the caller's."""
        extra = self._env()
        if not extra:
            return env
        return {**extra, **(env or {})}
