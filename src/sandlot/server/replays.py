"""Quota admission that lets a repeat of an idempotent call through to its first outcome.

A repeat with a key whose call already ran (or is running, or is at its gate) creates nothing:
it returns the first call's outcome, or is refused as a conflict when its request differs. So it
must not wait in a full tenant's quota queue, nor be refused 429 there; it takes no slot.

This module must not import the Manager, backends or a web framework.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio.to_thread

if TYPE_CHECKING:
    from sandlot.journal import Journal
    from sandlot.server.quotas import Admission

__all__ = ["admit"]


async def admit(
    admission: Admission, journal: Journal | None, tenant: str, key: str | None
) -> Callable[[], None]:
    """A slot of ``admission`` for a call by ``tenant`` with idempotency key ``key``.

    Returns:
        The slot's release; a no-op for a repeat of a call the journal already holds.
    """
    if (
        key is not None
        and journal is not None
        and admission.limit(tenant) is not None
        and await anyio.to_thread.run_sync(journal.taken, tenant, key)
    ):
        return _nothing
    return await admission.acquire(tenant)


def _nothing() -> None:
    """The release of a slot never taken."""
