"""The sync SDK: :class:`Sandlot` and :class:`Sandbox`, a thin facade over :mod:`sandlot.sdk`.

    with Sandlot() as client:
        with client.create() as sb:
            print(sb.exec("echo hi").stdout)

Each method runs its async twin on an event loop in a background (daemon) thread, so there
is one source of behaviour; a test checks the two surfaces match name for name and signature
for signature. Callbacks (``on_stdout``, …) are called on that loop's thread.

The sync handle :class:`Sandbox` and the client methods (:class:`SyncClientBase`) live in
:mod:`sandlot.facade`, which the HTTP client's sync :class:`sandlot.client.Client` shares, so the
sync surface is written once; this module adds :class:`Sandlot`'s constructor and re-exports
them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, final

from sandlot.facade import Sandbox, SyncClientBase
from sandlot.models import LOCAL_ACTOR, Actor, Approval
from sandlot.receipts import ReceiptLog
from sandlot.sdk import AsyncSandlot
from sandlot.shared import EventLoopThread

if TYPE_CHECKING:
    from sandlot.backends.base import Backend
    from sandlot.errors import PolicyDenied
    from sandlot.policy import PolicyConfig
    from sandlot.receipts import Receipt

__all__ = ["Sandbox", "Sandlot", "SyncClientBase"]


@final
class Sandlot(SyncClientBase[AsyncSandlot]):
    """The sync SDK on an embedded Manager; arguments as for :class:`AsyncSandlot`."""

    @property
    def receipts(self) -> ReceiptLog:
        """The signed receipt log."""
        return self._async.receipts

    def __init__(
        self,
        home: str | Path | None = None,
        backend: str | None = None,
        database: str | None = None,
        *,
        backends: Mapping[str, Backend] | None = None,
        actor: Actor = LOCAL_ACTOR,
        policy: str | Path | Sequence[str | Path] | PolicyConfig | None = None,
        hold_timeout: float = 300.0,
        on_deny: Callable[[PolicyDenied], object] | None = None,
        on_receipt: Callable[[Receipt], None] | None = None,
        on_hold: Callable[[Approval], object] | None = None,
        config: str | Path | None = None,
    ) -> None:
        self._loop = EventLoopThread()
        options = {
            "config": config,
            "backends": backends,
            "actor": actor,
            "policy": policy,
            "hold_timeout": hold_timeout,
            "on_deny": on_deny,
            "on_receipt": on_receipt,
            "on_hold": on_hold,
        }
        try:
            self._async = self._loop.run(_build(home, backend, database, options))
        except BaseException:
            self._loop.close()
            raise

    @property
    def home(self) -> Path:
        """The state directory."""
        return self._async.home


async def _build(
    home: str | Path | None, backend: str | None, database: str | None, options: dict[str, Any]
) -> AsyncSandlot:
    # Built on the loop thread, so everything the async client creates belongs to that loop.
    return AsyncSandlot(home, backend, database, **options)
