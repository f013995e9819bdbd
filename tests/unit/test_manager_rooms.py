"""The Manager's rooms compose into one class without one room silently replacing another's method.

A mixin defining a name another room (or the core) already defines would win or lose by its
place among ``Manager``'s bases, with no error: each method lives in exactly one room, and
each of the core's abstract declarations is implemented by exactly one room.
"""

from __future__ import annotations

import inspect

import sandlot.manager
from sandlot.manager import Manager
from sandlot.manager.core import ManagerCore

_INHERITED = set(vars(object)) | {"__abstractmethods__", "_abc_impl"}


def _rooms() -> list[type]:
    return [k for k in Manager.__mro__[1:] if issubclass(k, ManagerCore) and k is not ManagerCore]


def test_each_method_lives_in_one_room() -> None:
    homes: dict[str, list[str]] = {}
    for klass in (ManagerCore, *_rooms()):
        for name in vars(klass):
            if name in _INHERITED or name in {"__module__", "__doc__", "__qualname__"}:
                continue
            if getattr(vars(klass)[name], "__isabstractmethod__", False):
                continue  # a declaration, implemented below
            homes.setdefault(name, []).append(klass.__name__)
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    assert twice == {}


def test_every_declaration_is_implemented_by_one_room() -> None:
    declared = ManagerCore.__abstractmethods__
    assert declared, "the core declares what the rooms provide one another"
    for name in declared:
        implementers = [k.__name__ for k in _rooms() if name in vars(k)]
        assert len(implementers) == 1, (name, implementers)
        # The same parameters, spelled the same (return types may narrow the declared one).
        made = inspect.signature(getattr(Manager, name)).parameters
        assert made == inspect.signature(getattr(ManagerCore, name)).parameters, name
    assert not Manager.__abstractmethods__


def test_the_front_door_exports() -> None:
    assert sandlot.manager.__all__ == sorted(sandlot.manager.__all__)
    for name in sandlot.manager.__all__:
        assert hasattr(sandlot.manager, name), name
    # The tunables live in one place, read at run time: patching a copy elsewhere would
    # silently change nothing, so there is none.
    assert not hasattr(sandlot.manager, "RECENT")
    assert not hasattr(sandlot.manager, "TOUCH_EVERY")
