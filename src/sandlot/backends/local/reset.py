"""Resetting a ``local`` sandbox to its baseline or to a snapshot, verified from the host.

Every process ends, the writable layer is swapped for an empty one over the target's lower
layers (for the baseline, the layers the sandbox was created on; for a snapshot, its layer
re-hashed against its manifest first), the sandbox boots, and then :mod:`.verify` checks it.
The old writable layer is removed on a thread of its own. With a warm pool for the sandbox's
kind, a reset to the baseline swaps in a pooled sandbox instead (the same checks prove it) and
moves the old one to ``<state_dir>/.trash/``, destroyed in the background or before
returning. This module must not import the store, the Manager or front ends.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import threading
import time
from pathlib import Path

import anyio
import anyio.to_thread

from sandlot.backends import trust
from sandlot.backends.base import SnapshotRef
from sandlot.backends.local import layers, rootless
from sandlot.backends.local.state import LocalState, Meta
from sandlot.backends.local.verify import build_report, check_entry, verification_error
from sandlot.errors import BackendError, InvalidRequest, InvalidState, NotFound, SandboxError
from sandlot.models import JsonValue, SandboxSpec


class Reset(LocalState):
    """Resetting sandboxes (see the module docstring)."""

    async def reset(
        self, ref: str, snapshot: SnapshotRef | None, spec: SandboxSpec
    ) -> dict[str, JsonValue]:
        """Return the sandbox to ``snapshot`` (None: its baseline, as created), verified, booted.

        Every process ends and the writable layer is replaced by an empty one over the target's
        lower layers, so the files are exactly the target's whatever happened since. Before
        anything changes, the target's layers are checked (a snapshot layer is re-hashed
        against its manifest); after the boot the sandbox is checked from the host: its
        writable layer (the baseline's digest, or only the runtime's own mount points for a
        snapshot), the processes in its cgroup (the agent alone) and the runtime's record
        (running, that agent as init).

        With a warm pool for the sandbox's kind, a reset to the baseline of a default-root
        sandbox takes a pooled sandbox instead of restarting (a pooled sandbox is exactly such a
        baseline; the same checks prove it), and the old one is destroyed after: in the
        background while :meth:`pool_refiller` runs, else before returning.

        Returns:
            The verification report: ``ok``, ``target``, ``diverged``, timings and one check
            per source (``layers``, ``snapshot``, ``upper``, ``processes``, ``runtime``) with
            what was expected and what was found.

        Raises:
            VerificationFailed: a source disagreed (``details["diverged"]`` names them,
                ``details["verification"]`` is the report); a bad target leaves the sandbox
                untouched, a bad result leaves it as it is, for inspection.
            NotFound: no such sandbox or snapshot.
        """
        started = time.perf_counter()
        runtime = self._validate(ref, spec)
        self._ensure_subreaper()
        async with self._alock(ref):
            d, meta = self._meta(ref)
            if snapshot is None:
                swapped = await self._reset_by_claim(ref, d, meta, spec, runtime, started)
                if swapped is not None:
                    if swapped["diverged"]:
                        raise verification_error(ref, swapped)
                    return swapped
            checks: list[JsonValue] = []
            if snapshot is not None:
                target = f"snapshot:{snapshot.ref}"
                want = snapshot.metadata.get("manifest_sha256")
                try:
                    chain, _ = await anyio.to_thread.run_sync(self._snapshot_layers, snapshot)
                except NotFound:
                    raise
                except BackendError as e:
                    checks.append(check_entry("snapshot", str(want or "its manifest"), e.message))
                    raise verification_error(ref, build_report(target, checks, started)) from e
                found = layers.manifest_digest(self._snapshot_dir(snapshot.ref))
                checks.append(check_entry("snapshot", str(want or found), found))
                lowers: list[dict[str, JsonValue]] = [
                    {"path": str(lay.path), "key": lay.key} for lay in chain
                ]
                default_root = chain[-1].default_root
                expected_upper: str | None = None
            else:
                target = "baseline"
                if meta.baseline is None:
                    msg = (
                        f"sandbox {ref} has no recorded baseline (it was made by an older "
                        "sandlot); reset it to a snapshot instead"
                    )
                    raise InvalidState(msg)
                raw_layers = meta.baseline.get("layers")
                lowers = (
                    [dict(x) for x in raw_layers if isinstance(x, dict)]
                    if isinstance(raw_layers, list)
                    else []
                )
                default_root = bool(meta.baseline.get("default_root", True))
                upper = meta.baseline.get("upper")
                expected_upper = upper if isinstance(upper, str) else None
            lower_check = await anyio.to_thread.run_sync(self._check_lowers, lowers)
            checks.append(lower_check)
            if not lower_check["ok"]:
                raise verification_error(ref, build_report(target, checks, started))
            await self._halt(d, meta)
            meta.layers = lowers
            meta.default_root = default_root
            meta.pristine = None
            await anyio.to_thread.run_sync(self._fresh_layer, d, meta)
            meta.save(d / "meta.json")
            halted = time.perf_counter()
            await self._boot(d, meta, spec, keep_network=True)
            booted = time.perf_counter()
            state_checks, upper_digest = await self._check_running(d, meta, expected_upper)
            checks.extend(state_checks)
            report = build_report(target, checks, started)
            report["reset_ms"] = round((halted - started) * 1000, 2)
            report["boot_ms"] = round((booted - halted) * 1000, 2)
            meta.pristine = {"target": target, "upper": upper_digest, "at": time.time()}
            meta.save(d / "meta.json")
        if report["diverged"]:
            raise verification_error(ref, report)
        return report

    async def _reset_by_claim(
        self, ref: str, d: Path, meta: Meta, spec: SandboxSpec, runtime: str, started: float
    ) -> dict[str, JsonValue] | None:
        """Reset to the baseline by swapping in a pooled sandbox; None when that cannot serve
        (no pool, not a default-root baseline, a disk limit, published ports)."""
        base = meta.baseline
        isolation = self._poolable(spec)
        if base is None or isolation is None or meta.disk_mb is not None or spec.ports:
            return None
        if not self.pooled(isolation):
            return None
        try:
            certificates = trust.certificates_for(spec)
        except InvalidRequest:
            return None  # the operator's setting broke since: a plain reset needs none of it
        lowers = await anyio.to_thread.run_sync(self._lowers, spec, certificates)
        base_layers = base.get("layers")
        if not (
            isinstance(base_layers, list)
            and [lay.get("key") if isinstance(lay, dict) else None for lay in base_layers]
            == [lay.key for lay in lowers]
            and lowers[-1].default_root
        ):
            return None
        if self._networks is not None and meta.net_key is not None:
            with contextlib.suppress(NotFound):
                if await self._networks.list_ports(meta.net_key):
                    return None  # published ports belong to this sandbox's namespace
        trash = self.state_dir / ".trash" / f"{ref}-{secrets.token_hex(4)}"
        trash.parent.mkdir(exist_ok=True, mode=0o700)
        ready = self._ready.pop(ref, None)
        if ready is not None:
            with contextlib.suppress(Exception):
                await ready.close()
        # Its processes run on while it moves aside: what they use by path (the socket, the
        # layer) was opened already. Renamed in its record too, so tearing it down later
        # cannot touch what the new sandbox holds under this id.
        _move_aside(meta, d, trash)
        try:
            claimed = await self._claim(ref, spec, runtime, lowers)
        except BaseException:
            _untrash(trash, d, ref)
            raise
        if not claimed:
            _untrash(trash, d, ref)
            return None
        swapped = time.perf_counter()
        new_d, new_meta = self._meta(ref)
        new_meta.baseline = dict(base)
        want = ", ".join(str(lay.get("key")) for lay in base_layers if isinstance(lay, dict))
        lower_check = await anyio.to_thread.run_sync(self._check_lowers, list(new_meta.layers))
        lower_check["expected"] = want
        lower_check["ok"] = lower_check["actual"] == want
        expected_upper = base.get("upper")
        state_checks, upper_digest = await self._check_running(
            new_d, new_meta, expected_upper if isinstance(expected_upper, str) else None
        )
        report = build_report("baseline", [lower_check, *state_checks], started)
        report["reset_ms"] = round((swapped - started) * 1000, 2)
        report["boot_ms"] = 0.0
        report["via"] = "pool"
        new_meta.pristine = {"target": "baseline", "upper": upper_digest, "at": time.time()}
        new_meta.save(new_d / "meta.json")
        self._retire(trash)
        if self._refill is None:
            await self._destroy_trash(trash)
        return report

    def _retire(self, trash: Path) -> None:
        self._retiring.add(trash.name)
        if self._refill is not None:
            self._refill.start_soon(self._destroy_trash, trash)

    async def _destroy_trash(self, trash: Path) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await self._destroy_dir(trash)
        finally:
            self._retiring.discard(trash.name)

    async def _empty_trash(self) -> None:
        """Destroy sandboxes a reset swapped out and nobody destroyed (a crash, no refiller)."""
        tdir = self.state_dir / ".trash"
        if not tdir.is_dir():
            return
        for entry in list(tdir.iterdir()):
            if entry.name not in self._retiring:
                await self._destroy_dir(entry)

    def _fresh_layer(self, d: Path, meta: Meta) -> None:
        """An empty writable layer; the old one is removed on a thread of its own."""
        if meta.disk_mb is not None:
            self._reset_layer(d, meta)
            return
        layer = d / "layer"
        old = layer / f".old-{secrets.token_hex(4)}"
        old.mkdir(mode=0o700)
        for sub in ("upper", "work"):
            with contextlib.suppress(FileNotFoundError):
                (layer / sub).rename(old / sub)
        self._make_layer(d, meta)
        stale = sorted(layer.glob(".old-*"))
        # Removing a big layer takes as long as it is big; nothing waits for it (destroy
        # removes whatever is left with the sandbox's directory).
        threading.Thread(
            target=self._remove_stale, args=(stale,), name="sandlot-reset-gc", daemon=True
        ).start()

    def _remove_stale(self, paths: list[Path]) -> None:
        if self._idmap is None:
            _remove_trees(paths)
            return
        with contextlib.suppress(SandboxError):
            rootless.remove_trees(self._idmap, paths)


def _move_aside(meta: Meta, d: Path, trash: Path) -> None:
    meta.sandbox_id = trash.name
    meta.save(d / "meta.json")
    d.rename(trash)


def _untrash(trash: Path, d: Path, ref: str) -> None:
    """Undo :func:`_move_aside` (no pooled sandbox could be claimed after all)."""
    if d.exists() or not trash.exists():
        return
    trash.rename(d)
    meta = Meta.load(d / "meta.json")
    meta.sandbox_id = ref
    meta.save(d / "meta.json")


def _remove_trees(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
