"""Booting a ``local`` sandbox: from its record and bundle to an agent that answers.

A boot mounts the root (:mod:`.filesystem`) while the network namespace is prepared and the
bundle written (:mod:`.bundle`), then starts the runtime and waits for the agent. Under crun
the agent's listening socket is ours, made before the runtime starts and passed in as fd 3,
so the connection is opened at once and its handshake waits on the agent's start-up; the
init's pid and start time are recorded, and a boot that finds the recorded container still
running adopts it. Under runsc the socket is bound inside, on a small tmpfs of the sandbox's
own, and connected to without following links. This module must not import the store, the
Manager or front ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from sandlot.backends.local.mounts import mount_small_tmpfs, umount_tree
from sandlot.backends.local.runtime import Crun, process_alive, process_start_time, wait_exit
from sandlot.backends.local.state import LocalState, Meta, is_strict
from sandlot.errors import BackendError, NotFound, SandboxError, SandboxTimeout
from sandlot.models import SandboxSpec
from sandlot.taskgroups import lone_error

if TYPE_CHECKING:
    from sandlot.channel.base import Channel
    from sandlot.network.service import SandboxNetwork


class Boot(LocalState):
    """Starting the runtime and connecting to the agent (see the module docstring)."""

    async def _boot(
        self,
        d: Path,
        meta: Meta,
        spec: SandboxSpec,
        *,
        baseline: bool = False,
        keep_network: bool = False,
    ) -> None:
        """Mount, write the bundle, start the runtime and wait for the agent.

        ``baseline``: record the state right after boot as the sandbox's baseline (create).
        ``keep_network``: reuse the prepared network namespace when it is still there (reset).
        Independent steps overlap: the root filesystem is mounted while the network namespace
        is prepared and the bundle written, and the agent connection is opened before the
        runtime even starts (for crun the listening socket is ours), so its handshake waits
        on the agent's start-up rather than following it.
        """
        rt = self._runtimes[meta.runtime]
        name = meta.container
        if rt.has(name):
            state = await rt.state(name)
            if (
                state is not None
                and state.status == "running"
                and meta.init is not None
                and state.pid == meta.init[0]
                and process_alive(meta.init[0], meta.init[1])
            ):
                await self._wait_ready(d, meta)
                return
            if state is not None:
                # Not the container this record describes (or not running): start afresh.
                if state.pid > 0 and state.status in ("running", "created", "paused"):
                    await rt.kill(name, signal.SIGKILL)
                await anyio.to_thread.run_sync(self._reap_all, meta, 0.5)
                await rt.delete(name)
        profile: list[object] = []

        async def network_and_bundle() -> None:
            net: SandboxNetwork | None = None
            if self._networks is not None and meta.net_key is not None:
                # A reset keeps the namespace it had (the sandbox cannot change it: no
                # CAP_NET_ADMIN); rebuilding it is for boots after a stop or a reboot.
                net = self._kept_network(meta.net_key) if keep_network else None
                if net is None:
                    net = await self._networks.prepare(meta.net_key, spec.network)
            profile.append(await anyio.to_thread.run_sync(self._bundle, d, meta, spec, net))

        with lone_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, self._mount, d, meta)
                tg.start_soon(network_and_bundle)
        network = (
            self._networks is not None and meta.net_key is not None and spec.network != "deny-all"
        )
        if meta.runtime == "crun":
            slirp = meta.idmap is not None and spec.network == "allow-all"
            await self._start_crun(
                d, meta, profile[0], network=network, baseline=baseline, slirp=slirp
            )
            return
        # The sandbox can write here (it binds its socket here), so it is a tiny tmpfs of its
        # own rather than a directory of the host's /run.
        run = self._mnt(meta.container) / "run"
        umount_tree(run)
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(mode=0o700)
        mount_small_tmpfs(run, size_kb=64, owner=meta.uid_base or 0)
        pid_file = d / "init.pid"
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
        await rt.run(
            name,
            d,
            listen_fd=None,
            log=d / "logs" / "runtime.log",
            pid_file=pid_file,
            network=network,
        )
        self._record_init(d, meta, pid_file, baseline=baseline)
        await self._wait_ready(d, meta)

    def _kept_network(self, key: str) -> SandboxNetwork | None:
        if self._networks is None:
            return None
        try:
            net = self._networks.get(key)
        except NotFound:
            return None
        return net if Path(net.netns_path).exists() else None

    def _record_init(self, d: Path, meta: Meta, pid_file: Path, *, baseline: bool) -> None:
        rt = self._runtimes[meta.runtime]
        pid = int(pid_file.read_text().strip() or 0) if pid_file.exists() else 0
        start = process_start_time(pid) if pid else None
        meta.init = [pid, start] if pid and start is not None else None
        meta.host_pids = [
            [p, s]
            for p in rt.host_pids(meta.container, pid)
            if (s := process_start_time(p)) is not None
        ]
        meta.stop_reason = None
        meta.stop_detail = ""
        meta.booted = True
        if baseline:
            # The runtime has made its mount points by now and the agent writes nothing, so
            # this is the state a caller gets back from create (and from a baseline reset).
            meta.baseline = {
                "layers": [dict(lay) for lay in meta.layers],
                "default_root": meta.default_root,
                "upper": self._describe_upper(d, meta).digest,
            }
        meta.save(d / "meta.json")

    async def _start_crun(
        self,
        d: Path,
        meta: Meta,
        profile: object,
        *,
        network: bool,
        baseline: bool,
        slirp: bool = False,
    ) -> None:
        rt = self._runtimes["crun"]
        wrapper = self._rootless_wrapper(d, meta) if meta.idmap is not None else None
        sock_path = d / "agent.sock"
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        pid_file = d / "init.pid"
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
        connected: list[Channel] = []
        failed: list[BaseException] = []
        died: list[bool] = []
        connect_scope = anyio.CancelScope()
        watch_scope = anyio.CancelScope()

        async def connect() -> None:
            from sandlot.channel.client import connect_unix

            # The socket is ours (a directory the sandbox cannot see), so it is opened by
            # path; the O_PATH fd only works around sun_path's length limit.
            fd = os.open(sock_path, os.O_PATH | os.O_CLOEXEC)
            try:
                with connect_scope:
                    connected.append(
                        await connect_unix(f"/proc/self/fd/{fd}", timeout=self._ready_timeout)
                    )
            except (OSError, SandboxError) as e:
                failed.append(e)
            finally:
                os.close(fd)
                watch_scope.cancel()

        async def watch(pid: int, start: int) -> None:
            with watch_scope:
                await wait_exit(pid, start, self._ready_timeout + 5)
                if not process_alive(pid, start):
                    died.append(True)
                    connect_scope.cancel()

        try:
            if is_strict(meta.spec_model()):
                self._open_execgate(meta, d)
            _bind_unix(listener, sock_path)
            listener.listen(128)
            with lone_error():
                async with anyio.create_task_group() as tg:
                    # Queued in the listen backlog until the agent accepts it.
                    tg.start_soon(connect)
                    try:
                        await rt.run(
                            meta.container,
                            d,
                            listen_fd=listener.fileno(),
                            log=d / "logs" / "runtime.log",
                            pid_file=pid_file,
                            network=network,
                            wrapper=wrapper,
                        )
                    except BaseException:
                        connect_scope.cancel()
                        raise
                    finally:
                        listener.close()
                    self._record_init(d, meta, pid_file, baseline=baseline)
                    if meta.init is not None:
                        tg.start_soon(watch, meta.init[0], meta.init[1])
                        if slirp:
                            try:
                                await self._start_slirp(d, meta)
                            except BaseException:
                                connect_scope.cancel()
                                raise
        except BaseException:
            for ch in connected:
                with anyio.CancelScope(shield=True):
                    await ch.close()
            raise
        if isinstance(rt, Crun) and profile is not None:
            rt.learn_seccomp(meta.container, profile)
        if connected:
            old = self._ready.pop(meta.sandbox_id, None)
            self._ready[meta.sandbox_id] = connected[0]
            if old is not None:
                await old.close()
            return
        if died or (meta.init is not None and not process_alive(meta.init[0], meta.init[1])):
            msg = f"sandbox {meta.sandbox_id}: its agent exited while starting: {self._log_tail(d)}"
            raise BackendError(msg)
        err = failed[0] if failed else None
        msg = f"sandbox {meta.sandbox_id}: the agent did not answer: {err}: {self._log_tail(d)}"
        raise SandboxTimeout(msg) from err

    def _socket_path(self, d: Path, meta: Meta) -> Path:
        if meta.runtime == "runsc":
            return self._mnt(meta.container) / "run" / "agent.sock"
        return d / "agent.sock"

    async def _connect(self, d: Path, meta: Meta, timeout: float) -> Channel:
        from sandlot.channel.client import connect_unix

        path = self._socket_path(d, meta)
        deadline = time.monotonic() + timeout
        while True:
            fd = _open_socket_path(path)
            if fd is not None:
                try:
                    inner: Channel = await connect_unix(
                        f"/proc/self/fd/{fd}", timeout=max(0.1, deadline - time.monotonic())
                    )
                    return inner
                except (OSError, SandboxTimeout, BackendError) as e:
                    if time.monotonic() >= deadline:
                        msg = f"sandbox {meta.sandbox_id}: the agent did not answer: {e}"
                        raise SandboxTimeout(msg) from e
                finally:
                    os.close(fd)
            if meta.init is not None and not process_alive(meta.init[0], meta.init[1]):
                msg = f"sandbox {meta.sandbox_id}: its agent exited while starting: {self._log_tail(d)}"
                raise BackendError(msg)
            if time.monotonic() >= deadline:
                msg = f"sandbox {meta.sandbox_id}: the agent did not start in {timeout:.0f}s: {self._log_tail(d)}"
                raise SandboxTimeout(msg)
            await anyio.sleep(0.003)

    async def _wait_ready(self, d: Path, meta: Meta) -> None:
        inner = await self._connect(d, meta, self._ready_timeout)
        old = self._ready.pop(meta.sandbox_id, None)
        self._ready[meta.sandbox_id] = inner
        if old is not None:
            await old.close()

    def _log_tail(self, d: Path) -> str:
        try:
            with open(d / "logs" / "runtime.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 1500))
                return f.read().decode(errors="replace").strip() or "(no output)"
        except OSError:
            return "(no log)"


def _bind_unix(sock: socket.socket, path: Path) -> None:
    """Bind a unix socket at ``path`` even when the path is longer than ``sun_path`` allows."""
    raw = os.fsencode(path)
    if len(raw) < 100:
        sock.bind(raw)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.bind(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)


def _open_socket_path(path: Path) -> int | None:
    """An O_PATH fd of the socket at ``path``, refusing anything that is not a socket.

    The directory holding a gVisor sandbox's socket is writable from inside; opening without
    following symlinks and checking the type pins the inode we then connect to, so a planted
    symlink can never make the host connect somewhere else.
    """
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd
