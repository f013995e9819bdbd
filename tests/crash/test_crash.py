"""Crash safety of the journal, the Manager and the server: real processes, real ``kill -9``.

Each test is one run: fire operations at ``sandlot serve`` on the ``local`` backend (some with
idempotency keys), ``kill -9`` it at a random moment, restart it on the same home, retry every
keyed operation with its key, and check that nothing leaked or ran twice (``harness.py`` lists
the invariants). ``bench/crash.py --runs 100`` runs the full campaign.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.needs_root, pytest.mark.slow]

RUNS = int(os.environ.get("SANDLOT_CRASH_RUNS") or 5)
"""Runs per scenario (CI: 5, about two minutes for the three scenarios on 2 cores, each run
some 7 s; the campaign, ``bench/crash.py``: 100)."""


class _Campaign:
    scenario = ""

    @pytest.mark.parametrize("run", range(RUNS))
    def test_run(self, crash_suite, run: int) -> None:
        report = crash_suite.run(self.scenario, run)
        detail = "" if report.clean else f"\n--- server log ---\n{crash_suite.server.tail(30)}"
        assert report.clean, report.describe() + detail


class TestCreateCrash(_Campaign):
    """Creates (plain, with setup steps, with a main process; keyed or not) cut by a crash:
    no leaked sandbox, one sandbox per key, the retry answers it."""

    scenario = "create"


class TestExecCrash(_Campaign):
    """Commands cut by a crash: a keyed one runs at most once; its retry returns the first
    result or says the outcome is unknown (or that it never ran, and then it did not)."""

    scenario = "exec"


class TestDestroyCrash(_Campaign):
    """Destroys cut by a crash: nothing left on the host; a keyed retry answers the destroyed
    record."""

    scenario = "destroy"
