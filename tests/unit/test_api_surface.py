"""One API type: the in-process SDK and the HTTP client implement the documented protocols
(:mod:`sandlot.api`) name for name and signature for signature, and hand out one handle class."""

from __future__ import annotations

import inspect

import pytest

from sandlot.api import SandboxAPI, SandlotAPI
from sandlot.client import AsyncClient, AsyncRemoteSandbox
from sandlot.client.plane import HttpPlane
from sandlot.handle import AsyncSandbox, ControlPlane
from sandlot.sdk import AsyncSandlot, ManagerPlane


def _members(cls: type) -> dict[str, object]:
    """Public methods and properties, the protocol's own (not Protocol's machinery)."""
    found: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("sandlot"):
            found.update(vars(klass))
    return {
        name: member
        for name, member in found.items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }


def _signature_mismatches(protocol: type, implementation: type) -> list[str]:
    wanted, offered = _members(protocol), _members(implementation)
    problems = [f"missing {name}" for name in sorted(set(wanted) - set(offered))]
    problems += [f"not in the protocol: {name}" for name in sorted(set(offered) - set(wanted))]
    for name in sorted(set(wanted) & set(offered)):
        spec, impl = wanted[name], offered[name]
        if isinstance(spec, property):
            if not isinstance(impl, property):
                problems.append(f"{name}: a property in the protocol")
            continue
        spec_sig = inspect.signature(spec)  # type: ignore[arg-type]
        impl_sig = inspect.signature(impl)  # type: ignore[arg-type]
        if spec_sig != impl_sig:
            problems.append(f"{name}: {impl_sig} is not {spec_sig}")
        # Awaited in the protocol means awaited in the implementation; an async iterator
        # (declared ``def … -> AsyncIterator``) is an async generator there.
        if inspect.iscoroutinefunction(spec) != inspect.iscoroutinefunction(impl):
            problems.append(f"{name}: async in one and not the other")
    return problems


@pytest.mark.parametrize(
    ("protocol", "implementation"),
    [
        (SandlotAPI, AsyncSandlot),
        (SandlotAPI, AsyncClient),
        (SandboxAPI, AsyncSandbox),
        (ControlPlane, ManagerPlane),
        (ControlPlane, HttpPlane),
    ],
)
def test_implementations_match_their_protocol(protocol: type, implementation: type) -> None:
    assert _signature_mismatches(protocol, implementation) == []


def test_in_process_and_http_surfaces_match() -> None:
    # Each against the other directly, too: the protocol cannot drift from one of them alone.
    assert _signature_mismatches(AsyncSandlot, AsyncClient) == []
    assert _signature_mismatches(ManagerPlane, HttpPlane) == []


def test_one_handle_class() -> None:
    assert AsyncRemoteSandbox is AsyncSandbox
    for client in (AsyncSandlot, AsyncClient):
        assert inspect.signature(client.get).return_annotation == "AsyncSandbox"
        assert inspect.signature(client.create).return_annotation == "Creating[AsyncSandbox]"
        assert inspect.signature(client.fork).return_annotation == "builtins.list[AsyncSandbox]"


def test_every_protocol_member_is_documented() -> None:
    for protocol in (SandlotAPI, SandboxAPI, ControlPlane):
        for name, member in _members(protocol).items():
            assert getattr(member, "__doc__", None), f"{protocol.__name__}.{name}"


def test_the_comparison_can_fail() -> None:
    class Drifted:
        async def get(self, sandbox_id: int) -> AsyncSandbox:  # wrong parameter type
            raise NotImplementedError

        def list(self) -> None:  # not awaited, no parameters
            raise NotImplementedError

    Drifted.__module__ = "sandlot.test_drifted"
    problems = _signature_mismatches(SandlotAPI, Drifted)
    assert any(p.startswith("get:") for p in problems)
    assert any(p.startswith("list:") for p in problems)
    assert "missing create" in problems
