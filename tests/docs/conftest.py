"""The docs-example harness's report: what ran, what was skipped and why, what is a known defect.

``test_examples.py`` records one line per block through the ``docs_report`` fixture; the summary at the end of the
run lists every skip with its reason, so a skip never hides.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass
class Entry:
    block: str
    """``doc:line`` of the opening fence."""
    kind: str
    outcome: str
    """``passed``, ``failed``, ``skipped``, ``xfailed`` or ``not run`` (text blocks)."""
    seconds: float = 0.0
    why: str = ""


REPORT: dict[str, Entry] = {}


class Report:
    """What the tests write into the summary."""

    def record(self, block: str, kind: str, outcome: str, why: str = "") -> Entry:
        REPORT[block] = entry = Entry(block, kind, outcome, why=why)
        return entry


@pytest.fixture(scope="session")
def docs_report() -> Report:
    return Report()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORT:
        return
    entries = sorted(REPORT.values(), key=lambda e: e.block)
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.outcome] = counts.get(e.outcome, 0) + 1
    total = sum(e.seconds for e in entries)
    terminalreporter.section("docs examples")
    summary = ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))
    terminalreporter.write_line(f"{len(entries)} blocks: {summary}; {total:.0f} s running them")
    for e in entries:
        if e.outcome in ("skipped", "xfailed", "failed"):
            terminalreporter.write_line(f"  {e.outcome:8} {e.block} ({e.kind}): {e.why}")
