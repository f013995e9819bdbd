"""Task groups whose failure comes out as the exception it is.

anyio wraps whatever a task group's tasks (and its host) raise in a ``BaseExceptionGroup``.
Callers of sandlot handle errors by type (``NotFound``, ``BackendError``, …), so where a task
group only runs helpers beside one main piece of work, its first failure is re-raised alone.
This module imports nothing from sandlot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["lone_error"]


@contextlib.contextmanager
def lone_error() -> Iterator[None]:
    """Re-raise the first leaf of an exception group (chained to the group) instead of it."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
            leaf = leaf.exceptions[0]
        raise leaf from group
