"""Fixtures for the crash tests: a :class:`CrashSuite` (a home and a real ``sandlot serve`` on
the ``local`` backend) per scenario, torn down with everything its sandboxes left on the host.

The harness lives in ``harness.py`` beside this file so that ``bench/crash.py`` runs the same
campaign at full length; it is loaded by path (the tests directory is not a package).

``SANDLOT_CRASH_SEED`` replays a campaign (the seed is printed with every failure).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).parent


def _load_harness() -> ModuleType:
    name = "sandlot_crash_harness"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "harness.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


harness = _load_harness()
SEED = os.environ.get("SANDLOT_CRASH_SEED") or secrets.token_hex(4)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = harness.missing_prerequisite()
    for item in items:
        if HERE in Path(str(item.fspath)).parents and reason:
            item.add_marker(pytest.mark.skip(reason=f"needs {reason}"))


@pytest.fixture(scope="class")
def crash_suite(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    """The suite of the test class's ``scenario``: keys made, server started; at the end the
    server is stopped and whatever is left of the home's sandboxes is removed (and reported)."""
    scenario = request.cls.scenario  # type: ignore[union-attr]
    suite = harness.CrashSuite(tmp_path_factory.mktemp(f"crash-{scenario}"), seed=SEED)
    suite.start()
    try:
        yield suite
    finally:
        forced = suite.close()
    assert not forced, f"left on the host after the {scenario} campaign, removed by force: {forced}"
