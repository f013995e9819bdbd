"""The public surface: exports are sorted and the sync SDK mirrors the async one exactly."""

from __future__ import annotations

import inspect
import re

import pytest

import sandlot
from sandlot.sdk import AsyncSandbox, AsyncSandlot
from sandlot.sync import Sandbox, Sandlot
from sandlot.terminal import AsyncTerminal, Terminal


def test_all_is_sorted_and_complete() -> None:
    assert sandlot.__all__ == sorted(sandlot.__all__)
    for name in sandlot.__all__:
        assert hasattr(sandlot, name), name


def _public(cls: type) -> dict[str, object]:
    # Walk the bases too: the sync clients share their methods through a base class.
    members: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("sandlot"):
            members.update(vars(klass))
    return {
        name: member
        for name, member in members.items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }


def _sync_text(annotation: str) -> str:
    text = annotation.replace("AsyncIterator", "Iterator").replace("AsyncSandbox", "Sandbox")
    text = text.replace("AsyncIterable", "Iterable")
    text = re.sub(r"^Creating\[(.*)\]$", r"\1", text)
    text = re.sub(r"\bAsyncTerminal\b", "Terminal", text)
    return re.sub(r"\bAsyncSandlot\b", "Sandlot", text)


@pytest.mark.parametrize(
    ("async_cls", "sync_cls"),
    [(AsyncSandlot, Sandlot), (AsyncSandbox, Sandbox), (AsyncTerminal, Terminal)],
)
def test_sync_mirrors_async(async_cls: type, sync_cls: type) -> None:
    async_members = _public(async_cls)
    sync_members = _public(sync_cls)
    renames = {"aclose": "close"}
    # Plain attributes on the async side (set in __init__) are read-only properties on the sync side.
    data_attributes = {"info", "home", "receipts"}
    assert {renames.get(n, n) for n in async_members} == set(sync_members) - data_attributes
    for name, member in async_members.items():
        twin = sync_members[renames.get(name, name)]
        if isinstance(member, property):
            assert isinstance(twin, property), name
            continue
        a_sig = inspect.signature(member)  # type: ignore[arg-type]
        s_sig = inspect.signature(twin)  # type: ignore[arg-type]
        assert list(a_sig.parameters) == list(s_sig.parameters), name
        for pname, param in a_sig.parameters.items():
            other = s_sig.parameters[pname]
            assert param.kind == other.kind, (name, pname)
            assert param.default == other.default, (name, pname)
            assert _sync_text(str(param.annotation)) == str(other.annotation), (name, pname)
        assert _sync_text(str(a_sig.return_annotation)) == str(s_sig.return_annotation), name
        if inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member):
            assert not inspect.iscoroutinefunction(twin), name
        assert twin.__doc__, f"{sync_cls.__name__}.{name} has no docstring"  # type: ignore[union-attr]


def test_lazy_exports_resolve_and_import_stays_light() -> None:
    import subprocess
    import sys

    probe = "import sys, sandlot; print('sqlalchemy' in sys.modules, 'pydantic' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]
    for name in sandlot.__all__:
        assert getattr(sandlot, name) is not None
