"""The checks that show a ``local`` sandbox is as its last reset (or its create) left it.

Read from the host, never from inside the sandbox: its lower layers (a snapshot's layer
re-hashed against its manifest), its writable layer against the digest recorded then (or, for
a snapshot target, nothing but the runtime's mount points), the processes in its cgroup (the
agent alone) and the runtime's record (running, with that agent as init). Each check is one
``{source, expected, actual, ok}`` entry of a report; a report with a diverged source becomes
:class:`~sandlot.errors.VerificationFailed`. Also the host processes of a sandbox, for
accounting. This module must not import the store, the Manager or front ends.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import anyio.to_thread

from sandlot.backends.local import rootless
from sandlot.backends.local.runtime import process_alive
from sandlot.backends.local.state import LocalState, Meta
from sandlot.errors import BackendError, InvalidState, VerificationFailed
from sandlot.models import JsonValue


class Verification(LocalState):
    """Checking a running sandbox from the host (see the module docstring)."""

    async def verify(self, ref: str) -> dict[str, JsonValue]:
        """Check that a running sandbox is still as its last reset (or its create) left it.

        The same checks as after :meth:`reset`, without changing anything: its lower layers,
        its writable layer against the digest recorded then, the processes in its cgroup and
        the runtime's record. A sandbox that ran commands since, or whose files the host
        touched, fails it.

        Raises:
            VerificationFailed: a source disagreed (see :meth:`reset`).
            InvalidState: the sandbox is not running.
        """
        started = time.perf_counter()
        async with self._alock(ref):
            d, meta = self._meta(ref)
            if meta.init is None or not process_alive(meta.init[0], meta.init[1]):
                msg = f"sandbox {ref} is not running"
                raise InvalidState(msg)
            expected: str | None = None
            target = "baseline"
            if meta.pristine is not None:
                upper = meta.pristine.get("upper")
                expected = upper if isinstance(upper, str) else None
                target = str(meta.pristine.get("target", target))
            elif meta.baseline is not None and meta.baseline.get("layers") == meta.layers:
                upper = meta.baseline.get("upper")
                expected = upper if isinstance(upper, str) else None
            checks: list[JsonValue] = [
                await anyio.to_thread.run_sync(self._check_lowers, list(meta.layers))
            ]
            state_checks, _ = await self._check_running(d, meta, expected)
            checks.extend(state_checks)
        report = build_report(target, checks, started)
        if report["diverged"]:
            raise verification_error(ref, report)
        return report

    def _check_lowers(self, lowers: list[dict[str, JsonValue]]) -> dict[str, JsonValue]:
        """Every lower layer is there; snapshot layers still match their manifests."""
        keys = [str(lay.get("key", "")) for lay in lowers]
        problems: list[str] = []
        for lay in lowers:
            path = Path(str(lay.get("path", "")))
            if not path.is_dir():
                problems.append(f"{lay.get('key')} is missing")
                continue
            if path.name == "layer" and path.parent.parent == self.state_dir / ".snapshots":
                try:
                    self._verify_snapshot(path.parent)
                except BackendError as e:
                    problems.append(e.message)
        return check_entry("layers", ", ".join(keys), "; ".join(problems) or ", ".join(keys))

    async def _check_running(
        self, d: Path, meta: Meta, expected_upper: str | None
    ) -> tuple[list[JsonValue], str]:
        """The checks of a booted sandbox (writable layer, processes, runtime); and the digest
        of its writable layer."""
        manifest = await anyio.to_thread.run_sync(self._describe_upper, d, meta)
        strays = self._unexpected_upper(d, meta, manifest.entries)
        if expected_upper is not None:
            upper = check_entry("upper", expected_upper, manifest.digest)
        else:
            # No recorded digest to compare with (a snapshot target): the fresh layer may hold
            # only what the runtime and the backend make at boot.
            rule = "only the runtime's mount points"
            upper = check_entry(
                "upper", rule, rule if not strays else f"{len(strays)} other entries"
            )
            upper["digest"] = manifest.digest
        if strays and not upper["ok"]:
            upper["detail"] = ", ".join(strays[:10])
        checks: list[JsonValue] = [upper]
        rt = self._runtimes[meta.runtime]
        init = meta.init[0] if meta.init is not None else 0
        inside = await rt.inside_pids(meta.container)
        if inside is not None:
            # gVisor numbers the processes of its own kernel; the agent is its init.
            checks.append(check_entry("processes", "[1]", json.dumps(inside)))
        else:
            found = self._procs(meta)
            checks.append(check_entry("processes", json.dumps([init]), json.dumps(found)))
        state = rt.recorded_state(meta.container) or await rt.state(meta.container)
        actual = "missing" if state is None else f"{state.status} pid {state.pid}"
        checks.append(check_entry("runtime", f"running pid {init}", actual))
        return checks, manifest.digest

    def _unexpected_upper(self, d: Path, meta: Meta, entries: list[dict[str, object]]) -> list[str]:
        """Entries of a freshly booted writable layer that the runtime or the backend did not
        make: anything but empty mount points (files or directories) and the working
        directory, owned by the sandbox's root."""
        allowed: set[str] = set()
        try:
            mounts = json.loads((d / "config.json").read_text()).get("mounts", [])
        except (OSError, ValueError):
            mounts = []
        targets = [str(m.get("destination", "")) for m in mounts if isinstance(m, dict)]
        targets.append(str(meta.spec.get("workdir") or "/workspace"))
        for target in targets:
            parts = Path(target).parts[1:]
            for i in range(1, len(parts) + 1):
                allowed.add("/".join(parts[:i]))
        strays = []
        for e in entries:
            empty = e["type"] == "d" or (e["type"] == "f" and e.get("size") == 0)
            if str(e["path"]) not in allowed or not empty or e["uid"] != 0 or e["gid"] != 0:
                strays.append(str(e["path"]))
        return strays

    def host_processes(self, ref: str) -> list[int]:
        """Host pids of every process that runs for the sandbox: those in its cgroup (all of
        them under crun; gVisor's sentry under runsc) plus the host processes the runtime left
        beside them (gVisor's gofer). For accounting (memory, CPU); empty when stopped."""
        _, meta = self._meta(ref)
        pids = set(self._procs(meta) or [])
        for pid, start in meta.host_pids:
            if process_alive(pid, start):
                pids.add(pid)
        return sorted(pids)

    def _procs(self, meta: Meta) -> list[int] | None:
        """The sandbox's processes: its cgroup's, or (rootless, no cgroup) its init's tree."""
        if meta.idmap is not None:
            if meta.init is None or not process_alive(meta.init[0], meta.init[1]):
                return []
            return rootless.sandbox_pids(meta.init[0])
        return self._cgroup_procs(meta.container)

    def _cgroup_procs(self, container: str) -> list[int] | None:
        rel = self._cgroup_rel(container).lstrip("/")
        for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
            try:
                return sorted(
                    int(x) for x in (Path(base) / rel / "cgroup.procs").read_text().split()
                )
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                return None
        return None


def check_entry(source: str, expected: str, actual: str) -> dict[str, JsonValue]:
    return {"source": source, "expected": expected, "actual": actual, "ok": expected == actual}


def build_report(target: str, checks: list[JsonValue], started: float) -> dict[str, JsonValue]:
    diverged: list[JsonValue] = [
        c["source"] for c in checks if isinstance(c, dict) and not c.get("ok")
    ]
    return {
        "ok": not diverged,
        "target": target,
        "diverged": diverged,
        "duration_ms": round((time.perf_counter() - started) * 1000, 2),
        "checks": checks,
    }


def verification_error(ref: str, report: dict[str, JsonValue]) -> VerificationFailed:
    diverged = report.get("diverged")
    names = [str(x) for x in diverged] if isinstance(diverged, list) else []
    return VerificationFailed(
        f"local sandbox {ref} differs from {report.get('target')} in: {', '.join(names)}",
        verification=report,
        diverged=names,
    )
