"""The warm pool of the ``local`` backend: booted sandboxes waiting to be claimed.

A pool (``LocalBackend(pool={"namespaces": N})``) keeps booted default-root sandboxes, deny-all
and without an image, under ``<state_dir>/.pool/<isolation>/``. ``create`` (and a reset to the
baseline) claims one by an atomic ``renameat2(RENAME_NOREPLACE)`` of its directory, so two
processes never claim the same one, then writes the spec's limits into its cgroups, switches
its network policy and records its baseline. :meth:`Pool.pool_refiller` replaces claimed ones
in the background. This module must not import the store, the Manager or front ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Self

import anyio
import anyio.to_thread

from sandlot.backends import trust
from sandlot.backends.local import oci
from sandlot.backends.local.network import resolv_conf, set_resolv_conf
from sandlot.backends.local.rootfs import Layer
from sandlot.backends.local.runtime import process_alive
from sandlot.backends.local.state import ISOLATIONS, POOL_PREFIX, LocalState, Meta, is_strict
from sandlot.errors import BackendError
from sandlot.models import SandboxSpec

_SYS_RENAMEAT2 = 316
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _rename_noreplace(src: Path, dst: Path) -> bool:
    """Atomically move ``src`` to ``dst`` unless ``dst`` exists; False when someone else won."""
    ret = _libc.syscall(
        _SYS_RENAMEAT2, -100, os.fsencode(src), -100, os.fsencode(dst), _RENAME_NOREPLACE
    )
    if ret == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
        return False
    msg = f"cannot move {src} to {dst}: {os.strerror(err)}"
    raise BackendError(msg)


class Pool(LocalState):
    """Filling, claiming and draining the warm pool (see the module docstring)."""

    def _pool_entry(self, container: str) -> bool:
        return any((self.state_dir / ".pool").glob(f"*/{container}"))

    def pool_sizes(self) -> dict[str, int]:
        """The configured warm-pool size per isolation."""
        return dict(self._pool_sizes)

    def pooled(self, isolation: str = "namespaces") -> list[str]:
        """Names of the pooled sandboxes ready to be claimed."""
        pdir = self.state_dir / ".pool" / isolation
        if not pdir.is_dir():
            return []
        return sorted(p.name for p in pdir.iterdir() if (p / "ready").exists())

    async def fill_pool(self) -> None:
        """Boot pooled sandboxes until each isolation has its configured count."""
        self._ensure_subreaper()
        async with self._fill_lock:
            await self._fill_pool()

    async def _fill_pool(self) -> None:
        for isolation, size in self._pool_sizes.items():
            runtime = ISOLATIONS[isolation]
            if self._runtimes[runtime].available() or self.unavailable():
                continue
            missing = size - len(self.pooled(isolation))
            if missing <= 0:
                continue
            async with anyio.create_task_group() as tg:
                for _ in range(missing):
                    tg.start_soon(self._pool_one, isolation, runtime)

    async def _pool_one(self, isolation: str, runtime: str) -> None:
        pdir = self.state_dir / ".pool" / isolation
        pdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = f"{POOL_PREFIX}{secrets.token_hex(6)}"
        d = pdir / name
        spec = SandboxSpec(network="deny-all", backend_options={"local": {"isolation": isolation}})
        # With the operator's CAs: a pooled sandbox serves creates that ask for no others.
        lowers = await anyio.to_thread.run_sync(self._lowers, spec, trust.certificates_for(spec))
        meta = await anyio.to_thread.run_sync(self._provision, d, name, name, runtime, spec, lowers)
        if self._networks is not None:
            meta.net_key = name
            meta.save(d / "meta.json")
        try:
            await self._boot(d, meta, spec)
            ready = self._ready.pop(name, None)
            if ready is not None:
                await ready.close()
            (d / "ready").touch()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._destroy_dir(d)
            raise

    async def drain_pool(self) -> None:
        """Destroy every pooled sandbox of this state directory."""
        for pdir in (self.state_dir / ".pool").glob("*"):
            for d in list(pdir.iterdir()):
                await self._destroy_dir(d)

    def _poolable(self, spec: SandboxSpec) -> str | None:
        if spec.image is not None or spec.resources.disk_mb is not None or is_strict(spec):
            return None
        if self._idmap is not None and (spec.network != "deny-all" or spec.workdir != "/workspace"):
            # Rootless pooled sandboxes boot deny-all in a root that only the sandbox's own
            # namespace can see (no working directory can be made for it from the host).
            return None
        if self._networks is None and spec.network != "deny-all":
            return None
        isolation = str(spec.options_for("local").get("isolation", "namespaces"))
        res = spec.resources
        if isolation == "gvisor" and (res.memory_mb or res.pids or res.vcpus):
            # gVisor sizes its kernel from the limits at boot (memory, RLIMIT_NPROC); they
            # cannot be changed on a running sandbox the way cgroup files can.
            return None
        return isolation if self._pool_sizes.get(isolation) else None

    async def _claim(
        self, sandbox_id: str, spec: SandboxSpec, runtime: str, lowers: list[Layer]
    ) -> bool:
        isolation = self._poolable(spec)
        if isolation is None:
            return False
        # The extra CAs must be the ones the pool was made with (the operator's setting may
        # differ between the processes sharing this state directory).
        want = [lay.key for lay in lowers[:-1]]
        d = self._dir(sandbox_id)
        claimed = False
        for name in self.pooled(isolation):
            src = self.state_dir / ".pool" / isolation / name
            meta_path = src / "meta.json"
            try:
                meta = Meta.load(meta_path)
            except (OSError, ValueError, TypeError):
                continue
            if meta.init is None or not process_alive(meta.init[0], meta.init[1]):
                continue
            if [lay.get("key") for lay in meta.layers[:-1]] != want:
                continue
            if not _rename_noreplace(src, d):
                if d.exists():
                    break
                continue
            claimed = True
            break
        self._schedule_refill(isolation)
        if not claimed:
            return False
        try:
            meta = Meta.load(d / "meta.json")
            meta.sandbox_id = sandbox_id
            meta.spec = spec.model_dump(mode="json")
            with contextlib.suppress(FileNotFoundError):
                (d / "ready").unlink()
            await anyio.to_thread.run_sync(self._apply_resources, meta, spec)
            if (
                self._networks is not None
                and meta.net_key is not None
                and spec.network != "deny-all"
            ):
                net = await self._networks.update_policy(meta.net_key, spec.network)
                await anyio.to_thread.run_sync(
                    set_resolv_conf, d / "resolv.conf", resolv_conf(net.kind, slirp=False)
                )
            if spec.workdir != "/workspace":
                await anyio.to_thread.run_sync(
                    self._ensure_workdir, self._mnt(meta.container) / "rootfs", meta
                )
            meta.baseline = {
                "layers": [dict(lay) for lay in meta.layers],
                "default_root": meta.default_root,
                "upper": self._describe_upper(d, meta).digest,
            }
            meta.save(d / "meta.json")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._destroy_dir(d)
            raise
        return True

    def _apply_resources(self, meta: Meta, spec: SandboxSpec) -> None:
        """Write the spec's limits into a claimed sandbox's cgroups (v1 or v2)."""
        if meta.idmap is not None:
            return  # rootless: no cgroups, and specs with limits are refused
        rel = self._cgroup_rel(meta.container).lstrip("/")
        res = spec.resources
        v1 = Path("/sys/fs/cgroup/memory").is_dir()
        writes: list[tuple[Path, str]] = []
        pids = str(res.pids or oci.DEFAULT_PIDS)
        if v1:
            if res.memory_mb is not None:
                limit = str(res.memory_mb << 20)
                mem = Path("/sys/fs/cgroup/memory") / rel
                writes += [
                    (mem / "memory.limit_in_bytes", limit),
                    (mem / "memory.memsw.limit_in_bytes", limit),
                ]
            writes.append((Path("/sys/fs/cgroup/pids") / rel / "pids.max", pids))
            if res.vcpus is not None:
                cpu = Path("/sys/fs/cgroup/cpu") / rel
                writes += [
                    (cpu / "cpu.cfs_period_us", "100000"),
                    (cpu / "cpu.cfs_quota_us", str(max(1000, int(res.vcpus * 100000)))),
                ]
        else:
            base = Path("/sys/fs/cgroup") / rel
            if res.memory_mb is not None:
                writes += [
                    (base / "memory.max", str(res.memory_mb << 20)),
                    (base / "memory.swap.max", "0"),
                ]
            writes.append((base / "pids.max", pids))
            if res.vcpus is not None:
                writes.append((base / "cpu.max", f"{max(1000, int(res.vcpus * 100000))} 100000"))
        for path, value in writes:
            try:
                path.write_text(value)
            except OSError as e:
                if path.name == "memory.memsw.limit_in_bytes" and e.errno in (
                    errno.ENOENT,
                    errno.EINVAL,
                ):
                    continue  # no swap accounting on this kernel: the memory limit alone holds
                msg = f"cannot apply the limit {path.name}={value} to a claimed sandbox: {e}"
                raise BackendError(msg) from e

    def _schedule_refill(self, isolation: str) -> None:
        if self._refill is None or isolation in self._refilling:
            return
        self._refilling.add(isolation)

        async def refill() -> None:
            size = self._pool_sizes.get(isolation, 0)
            try:
                # Claims made while a refill runs are covered by looping until full.
                while len(self.pooled(isolation)) < size:
                    await self.fill_pool()
            except Exception:  # a failed refill only makes the next create cold
                pass
            finally:
                self._refilling.discard(isolation)

        self._refill.start_soon(refill)

    @contextlib.asynccontextmanager
    async def pool_refiller(self) -> AsyncIterator[Self]:
        """Keep the pool topped up in the background while the block runs::

        async with backend.pool_refiller():
            ...  # creates claim pooled sandboxes; claimed ones are replaced
        """
        async with anyio.create_task_group() as tg:
            self._refill = tg
            tg.start_soon(self.fill_pool)
            try:
                yield self
            finally:
                self._refill = None
                tg.cancel_scope.cancel()
