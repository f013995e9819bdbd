"""The lifecycle of a ``local`` sandbox: create, start, stop, destroy, inspect, list, connect.

These are the :class:`~sandlot.backends.base.Backend` calls, composing the other parts; those
that change a sandbox take its lock (an ``flock`` in ``<state_dir>/.locks/``, shared with every
process using this state directory). What the backend cannot enforce here is refused before
anything is made. ``create`` is idempotent per sandbox id: one left by
an earlier attempt is adopted, booted again if it is not running. This module must not import
the store, the Manager or front ends.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from sandlot.backends import trust
from sandlot.backends.base import BackendState
from sandlot.backends.local import protect, rootless
from sandlot.backends.local.channel import LocalChannel
from sandlot.backends.local.ids import RANGE_SIZE
from sandlot.backends.local.rootfs import trust_bundle
from sandlot.backends.local.runtime import process_alive
from sandlot.backends.local.state import (
    ISOLATIONS,
    POOL_PREFIX,
    VALID_ID,
    LocalState,
    Meta,
    is_strict,
)
from sandlot.backends.options import check_backend_options
from sandlot.errors import BackendUnavailable, InvalidRequest, InvalidState, NotFound, NotSupported
from sandlot.models import SandboxSpec

if TYPE_CHECKING:
    from sandlot.channel.base import Channel


class Lifecycle(LocalState):
    """Creating, starting, stopping, destroying and listing sandboxes (see the module docstring)."""

    def _validate(self, sandbox_id: str, spec: SandboxSpec) -> str:
        """Check what this backend must refuse; the runtime name for the spec."""
        if not VALID_ID.match(sandbox_id):
            msg = f"sandbox id {sandbox_id!r} must be 1-63 letters, digits, '.', '_' or '-'"
            raise InvalidRequest(msg)
        options = spec.options_for("local")
        check_backend_options({"local": options})  # declared in sandlot.backends.options
        protect.check(spec)
        isolation = str(options.get("isolation", "namespaces"))
        kind = spec.network if isinstance(spec.network, str) else "allowlist"
        if is_strict(spec) and (isolation != "namespaces" or self._idmap is not None):
            # runsc applies the profile in its own kernel and has no notify listener; rootless
            # crun could not read the callers' memory from outside their user namespace.
            why = "gVisor has no seccomp notify listener" if isolation != "namespaces" else ""
            msg = (
                "enforcement='strict' needs isolation='namespaces' (crun) run as root: "
                f"{why or 'this backend runs rootless'}"
            )
            raise NotSupported(msg)
        if self._idmap is not None:
            self._validate_rootless(spec, isolation, kind)
        if kind not in self.capabilities().network:
            msg = (
                f"network policy {kind!r} is not enforced by the local backend here: without the "
                "network service a sandbox has loopback only; use network='deny-all'"
            )
            raise NotSupported(msg)
        if isolation == "gvisor" and kind != "deny-all":
            # Measured with Debian's runsc (2022-12): joining a prepared namespace fails with
            # "cannot run with network enabled in root network namespace".
            msg = (
                f"network policy {kind!r} is not available with isolation='gvisor' on this "
                "runsc; gVisor sandboxes are deny-all (loopback only)"
            )
            raise NotSupported(msg)
        if spec.ports and self._networks is None:
            msg = "publishing ports needs the network service (the sandbox has loopback only)"
            raise NotSupported(msg)
        runtime = ISOLATIONS[isolation]
        if runtime not in self._usable:
            problem = self.unavailable() or self._runtimes[runtime].available()
            if problem:
                raise BackendUnavailable(problem)
            # Checked once: the checks read mount tables and may mount the hugetlb hierarchy.
            self._usable.add(runtime)
        return runtime

    def _validate_rootless(self, spec: SandboxSpec, isolation: str, kind: str) -> None:
        """What a rootless sandbox cannot have, refused before anything is made."""
        if isolation == "gvisor":
            msg = (
                "isolation='gvisor' needs root here: the local backend runs runsc only as root; "
                "without root use isolation='namespaces'"
            )
            raise NotSupported(msg)
        asked = sorted(k for k, v in spec.resources.model_dump().items() if v is not None)
        if asked:
            msg = (
                f"resource limits ({', '.join(asked)}) cannot be enforced without root here: "
                "this host delegates no cgroups to normal users (and disk_mb needs a loop "
                "mount); run sandlot as root for limits"
            )
            raise NotSupported(msg)
        if kind == "allowlist":
            msg = (
                "network allowlists need root (the egress proxy's namespaces and nftables); "
                "without root a sandbox gets deny-all or, with slirp4netns, allow-all"
            )
            raise NotSupported(msg)
        problem = rootless.slirp_problem() if kind == "allow-all" else None
        if problem is not None:
            msg = (
                f"network='allow-all' without root needs slirp4netns, and {problem}; "
                "without it a sandbox has loopback only (deny-all)"
            )
            raise NotSupported(msg)
        if spec.ports:
            msg = "publishing ports needs root (the network service); not available rootless"
            raise NotSupported(msg)

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> str:
        """Make and boot a sandbox (claiming a pooled one when the spec allows); its ref.

        Idempotent per ``sandbox_id``: a sandbox left by an earlier attempt is adopted (booted
        again if it is not running).
        """
        runtime = self._validate(sandbox_id, spec)
        # Before anything is made: a bad SANDLOT_CA_CERTS fails here.
        certificates = trust.certificates_for(spec)
        self._ensure_subreaper()
        d = self._dir(sandbox_id)
        async with self._alock(sandbox_id):
            if (d / "meta.json").exists():
                await self._adopt(d, spec)
                return sandbox_id
            if d.exists():
                # A create that crashed before writing meta.json left only empty directories.
                await anyio.to_thread.run_sync(self._wipe_dir, d)
            lowers = await anyio.to_thread.run_sync(self._lowers, spec, certificates)
            if await self._claim(sandbox_id, spec, runtime, lowers):
                return sandbox_id
            meta = await anyio.to_thread.run_sync(
                self._provision, d, sandbox_id, f"sl-{sandbox_id}", runtime, spec, lowers
            )
            try:
                await self._boot(d, meta, spec, baseline=True)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._destroy_dir(d)
                raise
        return sandbox_id

    async def _adopt(self, d: Path, spec: SandboxSpec) -> None:
        meta = Meta.load(d / "meta.json")
        if meta.sandbox_id != d.name:
            # A claim of a pooled sandbox was interrupted after the rename: finish it.
            meta.sandbox_id = d.name
            meta.spec = spec.model_dump(mode="json")
            if meta.init is not None and process_alive(meta.init[0], meta.init[1]):
                await anyio.to_thread.run_sync(self._apply_resources, meta, spec)
            meta.save(d / "meta.json")
        if meta.init is not None and process_alive(meta.init[0], meta.init[1]):
            if meta.sandbox_id not in self._ready:
                await self._wait_ready(d, meta)
            return
        await self._boot(d, meta, meta.spec_model())

    async def start(self, ref: str, spec: SandboxSpec) -> None:
        """Boot a stopped sandbox with its writable layer as it was."""
        self._ensure_subreaper()
        async with self._alock(ref):
            d, meta = self._meta(ref)
            if meta.init is not None and process_alive(meta.init[0], meta.init[1]):
                if ref not in self._ready:
                    await self._wait_ready(d, meta)
                return
            await self._halt(d, meta)
            await self._boot(d, meta, spec)

    async def stop(self, ref: str) -> None:
        """End every process (SIGTERM to the agent, SIGKILL after ``stop_timeout``) and unmount;
        the writable layer stays."""
        async with self._alock(ref):
            d, meta = self._meta(ref)
            if meta.init is not None and process_alive(meta.init[0], meta.init[1]):
                meta.stop_reason, meta.stop_detail = "stopped", "stopped by request"
            await self._halt(d, meta, grace=self._stop_timeout)
            meta.save(d / "meta.json")

    async def destroy(self, ref: str) -> None:
        """Remove the sandbox and everything it had on the host; a missing one is fine."""
        if not VALID_ID.match(ref):
            return
        d = self._dir(ref)
        async with self._alock(ref):
            await self._destroy_dir(d)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / ".locks" / ref).unlink()

    def _container_of(self, ref: str) -> str | None:
        try:
            return Meta.load(self._dir(ref) / "meta.json").container
        except (OSError, ValueError, TypeError):
            return None

    async def inspect(self, ref: str) -> BackendState:
        """``running``, ``stopped`` (with ``oom``/``exited``/``stopped`` as the reason) or
        ``missing``."""
        d = self._dir(ref)
        if not VALID_ID.match(ref) or not (d / "meta.json").exists():
            return BackendState("missing")
        _, meta = self._meta(ref)
        if meta.init is not None and process_alive(meta.init[0], meta.init[1]):
            return BackendState("running")
        if meta.init is not None and meta.stop_reason is None:
            async with self._alock(ref):
                _, meta = self._meta(ref)
                self._note_death(meta)
                meta.save(d / "meta.json")
        return BackendState("stopped", meta.stop_reason, meta.stop_detail)

    async def list_owned(self) -> dict[str, str]:
        """Every sandbox directory under the state directory (pool entries excluded), and
        containers of ours whose directory is gone (to be destroyed by ``reconcile``)."""
        await self._empty_trash()
        await anyio.to_thread.run_sync(self.release_leaked_uid_ranges)
        out: dict[str, str] = {}
        for entry in self.state_dir.iterdir():
            # Other services may keep state beside the sandboxes (the network service's
            # ``network/``, never a sandbox id). A directory without its meta.json is still a
            # sandbox's: a create killed before writing it left it, and with no ref recorded
            # the Manager's destroy finds it only here.
            if (
                entry.name.startswith(".")
                or not VALID_ID.match(entry.name)
                or entry.name == "network"
            ):
                continue
            if entry.is_dir():
                out[entry.name] = entry.name
        # A container whose directory is gone (a crash mid-destroy) is still ours to reap.
        for rt in self._runtimes.values():
            for name in rt.names():
                if name.startswith("sl-"):
                    sid = name[3:]
                    if VALID_ID.match(sid) and sid not in out:
                        out[sid] = sid
                elif (
                    name.startswith(POOL_PREFIX)
                    and not self._pool_entry(name)
                    and not any(self._container_of(ref) == name for ref in out)
                ):
                    # A claimed pooled sandbox whose directory is gone: its ref is the name.
                    out[name] = name
        return out

    def release_leaked_uid_ranges(self, *, min_age: float = 600.0) -> list[int]:
        """Free uid ranges recorded for this state directory that no sandbox uses any more
        (left by a crash between allocating and recording one); their first ids.

        Only records older than ``min_age`` seconds are considered, so a create in flight in
        another process (which allocates before it writes its record) is never robbed.
        """
        users: set[str] = set()
        for meta_path in [
            *self.state_dir.glob("*/meta.json"),
            *(self.state_dir / ".pool").glob("*/*/meta.json"),
            *(self.state_dir / ".trash").glob("*/meta.json"),
        ]:
            with contextlib.suppress(OSError, ValueError, TypeError):
                users.add(Meta.load(meta_path).container)
        for rt in self._runtimes.values():
            users.update(rt.names())
        freed = []
        now = time.time()
        for base, container in self._uids.owned_by(self.state_dir).items():
            if container in users:
                continue
            try:
                age = now - (self._uids.registry / str(base)).stat().st_mtime
            except FileNotFoundError:
                continue
            if age >= min_age:
                self._userns.forget(base, RANGE_SIZE)
                self._uids.release(base)
                freed.append(base)
        return freed

    async def channel(self, ref: str) -> Channel:
        """A connected channel to a running sandbox."""
        d, meta = self._meta(ref)
        if meta.init is None or not process_alive(meta.init[0], meta.init[1]):
            msg = f"sandbox {ref} is not running"
            raise InvalidState(msg)
        inner = self._ready.pop(ref, None)
        if inner is None:
            inner = await self._connect(d, meta, 10.0)
        spec = meta.spec_model()
        bundle = trust_bundle([str(lay.get("key", "")) for lay in meta.layers])
        # The extra CAs' variables under the spec's own (a user's SSL_CERT_FILE wins).
        spec_env = {**(trust.environment(bundle) if bundle else {}), **spec.env}
        networks, key = self._networks, meta.net_key

        def env() -> dict[str, str]:
            # Asked per command: the proxy variables of the policy in force now (it may have
            # changed since this channel was made, by any process); the spec's own win.
            if networks is None or key is None:
                return spec_env
            try:
                proxy = networks.env(key)
            except NotFound:
                return spec_env
            return {**proxy, **spec_env} if proxy else spec_env

        return LocalChannel(
            inner,
            env=env,
            workdir=spec.workdir,
            oom_files=lambda: self._oom_files(meta.container),
        )
