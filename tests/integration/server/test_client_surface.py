"""The HTTP client offers the in-process SDK's surface: same names, same signatures, same
return types (with the client classes renamed; the handles, async and sync, are the SDK's own
``AsyncSandbox`` and ``Sandbox``), and its sync facade mirrors its async side."""

from __future__ import annotations

import inspect
import re

import pytest

from sandlot.client import AsyncClient, AsyncRemoteSandbox, Client
from sandlot.sdk import AsyncSandbox, AsyncSandlot
from sandlot.sync import Sandbox, Sandlot

# Attributes that are data, not behaviour, and differ by nature: where the state lives (an SDK's
# home, its local receipt log) versus where the server is (a client's URL).
_DATA = {"home", "url", "info", "receipts"}


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


def _client_text(annotation: str) -> str:
    text = re.sub(r"\bAsyncSandlot\b", "AsyncClient", annotation)
    return re.sub(r"\bSandlot\b", "Client", text)


def _sync_text(annotation: str) -> str:
    text = annotation.replace("AsyncIterator", "Iterator").replace("AsyncSandbox", "Sandbox")
    text = text.replace("AsyncIterable", "Iterable")
    text = re.sub(r"^Creating\[(.*)\]$", r"\1", text)  # awaited or entered: the sync twin's value
    text = re.sub(r"\bAsyncTerminal\b", "Terminal", text)
    return re.sub(r"\bAsyncClient\b", "Client", text)


def _compare(left: type, right: type, translate: object, *, renames: dict[str, str]) -> None:
    a_members, b_members = _public(left), _public(right)
    assert {renames.get(n, n) for n in a_members} - _DATA == set(b_members) - _DATA
    for name, member in a_members.items():
        if name in _DATA:
            continue
        twin = b_members[renames.get(name, name)]
        if isinstance(member, property):
            assert isinstance(twin, property), name
            continue
        a_sig = inspect.signature(member)  # type: ignore[arg-type]
        b_sig = inspect.signature(twin)  # type: ignore[arg-type]
        assert list(a_sig.parameters) == list(b_sig.parameters), name
        for pname, param in a_sig.parameters.items():
            other = b_sig.parameters[pname]
            assert param.kind == other.kind, (name, pname)
            assert param.default == other.default, (name, pname)
            assert translate(str(param.annotation)) == str(other.annotation), (name, pname)  # type: ignore[operator]
        assert translate(str(a_sig.return_annotation)) == str(b_sig.return_annotation), name  # type: ignore[operator]
        assert twin.__doc__, f"{right.__name__}.{name} has no docstring"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("sdk_cls", "client_cls"),
    [
        (AsyncSandlot, AsyncClient),
        (AsyncSandbox, AsyncRemoteSandbox),
        (Sandlot, Client),
    ],
)
def test_client_mirrors_the_sdk(sdk_cls: type, client_cls: type) -> None:
    _compare(sdk_cls, client_cls, _client_text, renames={})
    for name, member in _public(sdk_cls).items():
        twin = _public(client_cls).get(name)
        if twin is None or isinstance(member, property):
            continue
        # An async method stays async (and a generator a generator) on the client.
        assert inspect.iscoroutinefunction(member) == inspect.iscoroutinefunction(twin), name
        assert inspect.isasyncgenfunction(member) == inspect.isasyncgenfunction(twin), name


@pytest.mark.parametrize(
    ("async_cls", "sync_cls"), [(AsyncClient, Client), (AsyncRemoteSandbox, Sandbox)]
)
def test_sync_client_mirrors_async_client(async_cls: type, sync_cls: type) -> None:
    _compare(async_cls, sync_cls, _sync_text, renames={"aclose": "close"})
    for name, member in _public(async_cls).items():
        if inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member):
            assert not inspect.iscoroutinefunction(
                _public(sync_cls)[{"aclose": "close"}.get(name, name)]
            ), name


def test_the_client_hands_out_the_sdk_handle() -> None:
    # One handle class: the old name is the same class, so code written for either works.
    assert AsyncRemoteSandbox is AsyncSandbox
    assert inspect.signature(AsyncClient.get).return_annotation == "AsyncSandbox"


def test_the_surface_test_can_fail() -> None:
    class Narrower:
        def get(self, sandbox_id: int) -> AsyncSandbox:  # wrong parameter type
            """Doc."""
            raise NotImplementedError

    with pytest.raises(AssertionError):
        _compare(AsyncSandlot, Narrower, _client_text, renames={})
