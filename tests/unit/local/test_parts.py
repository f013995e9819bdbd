"""How ``LocalBackend`` is put together: parts over one base, each concern in one place.

Each part implements its own methods and none overrides another's, so the order of the bases
never decides which code runs; what one part calls of another is declared on ``LocalState``
(for mypy) and implemented by exactly one part; and the package imports nothing above the
backends.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import sandlot.backends.local as local_pkg
from sandlot.backends.local import LocalBackend
from sandlot.backends.local.state import LocalState

PACKAGE = Path(local_pkg.__file__).parent
PARTS = [c for c in LocalBackend.__mro__[1:] if c is not LocalState and c is not object]


def _own_methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if inspect.isfunction(value)} | {
        name for name, value in vars(cls).items() if isinstance(value, property)
    }


def _declared() -> set[str]:
    """The methods LocalState declares under ``TYPE_CHECKING`` (never defined at run time)."""
    tree = ast.parse((PACKAGE / "state.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LocalState")
    block = next(n for n in cls.body if isinstance(n, ast.If))
    return {n.name for n in block.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_part_is_a_local_state_from_its_own_module() -> None:
    assert len(PARTS) >= 10
    modules = [part.__module__ for part in PARTS]
    assert len(set(modules)) == len(modules), modules
    for part in PARTS:
        assert issubclass(part, LocalState), part
        assert part.__module__.startswith("sandlot.backends.local."), part


def test_no_part_overrides_another() -> None:
    owner: dict[str, str] = {}
    for cls in [LocalBackend, *PARTS, LocalState]:
        for name in _own_methods(cls) - {"__init__"}:
            assert name not in owner, f"{name} is in both {owner.get(name)} and {cls.__name__}"
            owner[name] = cls.__name__


def test_what_parts_call_of_one_another_is_implemented_once() -> None:
    declared = _declared()
    assert declared, "LocalState declares the methods the parts call of one another"
    for name in sorted(declared):
        # Declared for the type checker only: a stub at run time would hide a missing part.
        assert name not in vars(LocalState), name
        owners = [c.__name__ for c in (LocalBackend, *PARTS) if name in vars(c)]
        assert len(owners) == 1, f"{name} is implemented by {owners or 'no part'}"


def test_the_package_imports_nothing_above_the_backends() -> None:
    forbidden = ("store", "manager", "server", "cli", "mcp", "client", "sdk", "sync", "gate")
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                assert not (parts[0] == "sandlot" and len(parts) > 1 and parts[1] in forbidden), (
                    f"{path.name} imports {name}"
                )


def test_parts_do_not_import_one_another() -> None:
    part_classes = {part.__name__ for part in PARTS}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "backend.py":
            continue  # the composition
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                imported = {alias.name for alias in node.names}
                assert not imported & part_classes, f"{path.name} imports {imported & part_classes}"
