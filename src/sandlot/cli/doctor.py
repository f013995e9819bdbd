"""``sandlot doctor``: what works on this host, and for what doesn't, the reason and the fix.

Each backend package may offer ``doctor() -> list[DoctorCheck]``; the doctor adds the checks
every installation needs (the state directory, the database). A database that cannot be
reached, or a backend setting a backend refuses, is a failed check naming the fix, never a
crash. Nothing here changes the host.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sandlot.backends.base import DoctorCheck
from sandlot.backends.registry import BACKEND_NAMES, default_backend_name
from sandlot.config import home as resolve_home
from sandlot.errors import SandboxError

__all__ = ["collect", "run_doctor"]


def _general(home_arg: Path | None, database: str | None) -> list[DoctorCheck]:
    checks = [
        DoctorCheck(
            "python",
            sys.version_info >= (3, 11),
            f"{sys.version.split()[0]} at {sys.executable}",
            "install Python 3.11 or newer",
        )
    ]
    try:
        home = resolve_home(home_arg)
        writable = os.access(home, os.W_OK)
        checks.append(DoctorCheck("state directory", writable, str(home), f"make {home} writable"))
    except (SandboxError, OSError) as e:
        checks.append(
            DoctorCheck(
                "state directory", False, str(e), "set SANDLOT_HOME to a writable directory"
            )
        )
        return checks
    from sandlot.wiring import check_database, database_url, redact_url

    fix = "check --database / SANDLOT_DATABASE_URL"
    try:
        url = database_url(database, home)
        check_database(url)
    except SandboxError as e:
        checks.append(DoctorCheck("database", False, e.message, fix))
        return checks
    checks.append(DoctorCheck("database", True, redact_url(url)))
    checks.append(_reconcile_check(url))
    from sandlot.backends import trust

    checks.append(trust.doctor_check())
    return checks


def _reconcile_check(url: str) -> DoctorCheck:
    """Operations the journal could not settle after a crash (an operator must look)."""
    from sandlot.journal import IntentState
    from sandlot.wiring import open_journal

    try:
        with open_journal(url) as journal:
            stuck = journal.list(states=[IntentState.NEEDS_RECONCILE.value])
    except SandboxError as e:
        return DoctorCheck("journal", False, str(e), "check the database")
    if not stuck:
        return DoctorCheck("journal", True, "no operation needs reconciling")
    detail = "; ".join(
        f"{i.op} {i.sandbox_id or ''} ({i.error or 'no detail'})".strip() for i in stuck[:5]
    )
    return DoctorCheck(
        f"journal: {len(stuck)} operation(s) NEEDS_RECONCILE",
        False,
        detail,
        "check the backend for each sandbox named, then `sandlot reconcile`",
    )


def _backend_checks(name: str) -> list[DoctorCheck]:
    if name == "fake":
        return [DoctorCheck("fake", True, "in memory (for tests); no isolation")]
    try:
        module = importlib.import_module(f"sandlot.backends.{name}")
    except ImportError as e:
        return [DoctorCheck(name, False, f"not in this build: {e}", "upgrade sandlot")]
    probe = getattr(module, "doctor", None)
    if probe is None:
        return [DoctorCheck(name, False, "this backend offers no self-check", "")]
    try:
        return [
            DoctorCheck(f"{name}: {c.name}", c.ok, c.detail, c.fix, c.required) for c in probe()
        ]
    except SandboxError as e:
        # A setting the backend refuses (SANDLOT_MICROVM_ACCEL=kvm where KVM cannot run a
        # guest): what every create would fail with, so it is a failed check, not a crash.
        return [DoctorCheck(name, False, e.message, "")]
    except Exception as e:
        return [DoctorCheck(name, False, f"self-check crashed: {e!r}", "report a bug")]


def collect(home: Path | None, database: str | None) -> dict[str, list[DoctorCheck]]:
    """Every check, grouped: ``general`` and one group per backend."""
    groups = {"general": _general(home, database)}
    for name in BACKEND_NAMES:
        groups[name] = _backend_checks(name)
    return groups


def run_doctor(home: Path | None, database: str | None, *, as_json: bool, console: Console) -> int:
    """Print the checks; exit code 0 when the default backend and the basics work."""
    groups = collect(home, database)
    try:
        default = default_backend_name(None)
    except SandboxError:
        default = "local"
    # A failed optional check (gVisor, umoci, a rootless user's missing limits) costs a feature,
    # not the backend.
    usable = {
        name: all(c.ok or not c.required for c in checks)
        for name, checks in groups.items()
        if name != "general"
    }
    ok = all(c.ok for c in groups["general"]) and usable.get(default, False)
    if as_json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "default_backend": default,
                    "backends": {n: {"usable": u} for n, u in usable.items()},
                    "checks": {
                        g: [
                            {
                                "name": c.name,
                                "ok": c.ok,
                                "required": c.required,
                                "detail": c.detail,
                                "fix": c.fix,
                            }
                            for c in cs
                        ]
                        for g, cs in groups.items()
                    },
                },
                indent=2,
            )
        )
        return 0 if ok else 1
    for group, checks in groups.items():
        title = (
            group
            if group == "general"
            else f"backend {group}" + (" (default)" if group == default else "")
        )
        verdict = (
            ""
            if group == "general"
            else (" [green]usable[/green]" if usable[group] else " [red]not usable[/red]")
        )
        console.print(f"[bold]{title}[/bold]{verdict}")
        table = Table.grid(padding=(0, 2))
        for c in checks:
            mark = (
                "[green]ok[/green]"
                if c.ok
                else ("[red]no[/red]" if c.required else "[yellow]--[/yellow]")
            )
            # Details quote URLs and commands (pip install 'sandlot[postgres]'): not markup.
            table.add_row(f"  {mark}", escape(c.name), escape(c.detail))
            if not c.ok and c.fix:
                table.add_row("", "", f"[yellow]fix:[/yellow] {escape(c.fix)}")
        console.print(table)
    return 0 if ok else 1
