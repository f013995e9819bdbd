"""Stopping and removing a ``local`` sandbox on the host.

Halting ends its processes (SIGTERM to the agent, SIGKILL after the grace period, thawing
them first if a snapshot left them frozen), records once why its init died (``oom`` or
``exited``), reaps, deletes the container from its runtime and unmounts its root; removing
it also takes its directory, cgroups, network namespace and uid range. This module must not
import the store, the Manager or front ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import anyio
import anyio.to_thread

from sandlot.backends.local import rootless
from sandlot.backends.local.channel import read_oom_kills
from sandlot.backends.local.ids import RANGE_SIZE
from sandlot.backends.local.mounts import umount_tree
from sandlot.backends.local.runtime import Runtime, process_alive, reap, wait_exit
from sandlot.backends.local.state import POOL_PREFIX, LocalState, Meta
from sandlot.errors import BackendError


class Teardown(LocalState):
    """Halting and removing sandboxes (see the module docstring)."""

    async def _halt(self, d: Path, meta: Meta, *, grace: float = 0.0) -> None:
        """Kill the container, delete it from the runtime, reap, unmount (idempotent)."""
        ready = self._ready.pop(meta.sandbox_id, None)
        if ready is not None:
            with contextlib.suppress(Exception):
                await ready.close()
        rt = self._runtimes[meta.runtime]
        alive = meta.init is not None and process_alive(meta.init[0], meta.init[1])
        if alive and meta.idmap is not None and meta.init is not None:
            # A snapshot that never finished may have left them stopped (SIGSTOP), and a
            # stopped init would not act on SIGTERM within the grace period.
            rootless.thaw(rootless.sandbox_pids(meta.init[0]))
        elif alive and self._frozen(meta.container):
            # Left paused by a snapshot that never finished: frozen tasks ignore signals.
            with contextlib.suppress(BackendError):
                await rt.resume(meta.container)
        if alive and grace > 0:
            await self._signal_init(rt, meta, signal.SIGTERM)
            assert meta.init is not None
            await wait_exit(meta.init[0], meta.init[1], grace)
        if meta.init is not None and process_alive(meta.init[0], meta.init[1]):
            await self._signal_init(rt, meta, signal.SIGKILL)
            await wait_exit(meta.init[0], meta.init[1], 5.0)
        if meta.slirp is not None:
            slirp_pid, slirp_start = meta.slirp
            await anyio.to_thread.run_sync(rootless.stop_slirp, slirp_pid, slirp_start)
            meta.slirp = None
        self._note_death(meta)
        # Reap first: runsc waits for its sandbox and gofer processes to vanish, and a zombie
        # of ours would keep it waiting until its deadline.
        await anyio.to_thread.run_sync(self._reap_all, meta, 0.5)
        # crun's host processes were recorded at boot; asking it first costs a whole run.
        known = None
        if meta.runtime == "crun":
            recorded = [(int(p[0]), int(p[1])) for p in meta.host_pids]
            if meta.init is not None:
                recorded.append((int(meta.init[0]), int(meta.init[1])))
            known = recorded
        await rt.delete(meta.container, known)
        await anyio.to_thread.run_sync(self._reap_all, meta, 2.0)
        await anyio.to_thread.run_sync(self._unmount, d, meta)
        await anyio.to_thread.run_sync(self._close_execgate, meta.sandbox_id)
        meta.init = None
        meta.host_pids = []

    def _frozen(self, container: str) -> bool:
        rel = self._cgroup_rel(container).lstrip("/")
        for path in (
            Path("/sys/fs/cgroup/freezer") / rel / "freezer.state",
            Path("/sys/fs/cgroup") / rel / "cgroup.freeze",
        ):
            with contextlib.suppress(OSError):
                return path.read_text().strip() in ("FROZEN", "FREEZING", "1")
        return False

    async def _signal_init(self, rt: Runtime, meta: Meta, sig: int) -> None:
        # Under crun the init is an ordinary host process (pid and start time recorded), and
        # signalling it directly saves a runtime invocation; gVisor's init lives in its kernel.
        if meta.runtime == "crun" and meta.init is not None:
            if process_alive(meta.init[0], meta.init[1]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(meta.init[0], sig)
            return
        await rt.kill(meta.container, sig)

    def _note_death(self, meta: Meta) -> None:
        """Record why the init died, once, while its cgroup still exists."""
        if meta.init is None or meta.stop_reason is not None:
            return
        if process_alive(meta.init[0], meta.init[1]):
            return
        status = reap(meta.init[0], meta.init[1], timeout=0.5)
        if read_oom_kills(self._oom_files(meta.container)) > 0 and (
            status is None or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)
        ):
            meta.stop_reason = "oom"
            meta.stop_detail = "the sandbox's init (its agent) was killed by the memory limit"
        else:
            meta.stop_reason = "exited"
            if status is not None:
                meta.stop_detail = f"the sandbox's init exited ({_describe_status(status)})"

    def _reap_all(self, meta: Meta, timeout: float) -> None:
        pids = [(p[0], p[1]) for p in meta.host_pids]
        if meta.init is not None:
            pids.append((meta.init[0], meta.init[1]))
        deadline = time.monotonic() + timeout
        for pid, start in dict.fromkeys(pids):
            reap(pid, start, timeout=max(0.0, deadline - time.monotonic()))

    def _unmount(self, d: Path, meta: Meta) -> None:
        umount_tree(self._mnt(meta.container))
        if meta.disk_mb is not None:
            umount_tree(d / "layer")

    async def _destroy_dir(self, d: Path) -> None:
        try:
            meta: Meta | None = Meta.load(d / "meta.json")
        except (OSError, ValueError, TypeError):
            meta = None
        if meta is not None:
            await self._halt(d, meta)
            if self._networks is not None and meta.net_key is not None:
                await self._networks.teardown(meta.net_key)
            containers = [meta.container]
        else:
            # No record (a crash mid-create or mid-destroy): the names derive from the ref.
            containers = [f"sl-{d.name}"]
            if d.name.startswith(POOL_PREFIX):
                containers.append(d.name)
            for name in containers:
                for rt in self._runtimes.values():
                    await rt.delete(name)
            for base, name in self._uids.owned_by(self.state_dir).items():
                if name in containers:
                    self._userns.forget(base, RANGE_SIZE)
                    self._uids.release(base)
        for name in containers:
            await anyio.to_thread.run_sync(self._remove_cgroups, name)
            await anyio.to_thread.run_sync(self._wipe_dir, self._mnt(name))
        await anyio.to_thread.run_sync(self._wipe_dir, d)
        if meta is not None and meta.uid_base is not None:
            self._userns.forget(meta.uid_base, RANGE_SIZE)
            self._uids.release(meta.uid_base)
        self._gc_snapshots()

    def _wipe_dir(self, d: Path) -> None:
        if self._idmap is not None:
            # Nothing of a rootless sandbox is mounted on the host; what it wrote may belong
            # to the caller's subordinate ids.
            rootless.remove_trees(self._idmap, [d])
            return
        umount_tree(d)
        # A reset may still be removing an old writable layer below ``d`` on another thread;
        # both sides ignore what the other removed first.
        for _ in range(3):
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                return
            umount_tree(d)
        shutil.rmtree(d)

    def _remove_cgroups(self, container: str) -> None:
        # Only the sandbox's own directory: the shared ``sandlot/<tag>`` parents stay while the
        # backend is in use, because removing them races with the runtime making a sibling
        # (another task or process), which then fails with ENOENT.
        if self._idmap is not None:
            return  # rootless sandboxes have no cgroups of their own
        rel = self._cgroup_rel(container).lstrip("/")
        roots = [p for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir()]
        for root in [*roots, Path("/sys/fs/cgroup")]:
            with contextlib.suppress(OSError):
                (root / rel).rmdir()

    def _remove_tag_cgroups(self) -> None:
        """The backend's empty ``sandlot/<tag>`` cgroup directories (when it has no sandbox)."""
        if self._idmap is not None:
            return
        rel = self._cgroup_rel("x").lstrip("/").rsplit("/", 1)[0]
        roots = [p for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir()]
        for root in [*roots, Path("/sys/fs/cgroup")]:
            with contextlib.suppress(OSError):
                (root / rel).rmdir()


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"
