"""The OCI runtimes behind the local backend (``crun``, ``runsc``) and the host quirks they need.

A :class:`Runtime` runs a bundle detached, signals, pauses, deletes and lists containers kept in
its own state root (one per backend state directory, under ``/run/sandlot``), and knows which
host processes belong to a container so the caller can reap them. Host fixes live here too, each
applied in code, idempotently, with a clear error when impossible:

- on a cgroup v1/v2 hybrid host crun needs the ``hugetlb`` v1 hierarchy mounted, else it fails
  with "cgroups in hybrid mode not supported" (:func:`ensure_hugetlb_hierarchy`);
- ``crun run -d`` leaves the container's init re-parented to the nearest child subreaper; the
  process running the backend becomes one (:func:`become_subreaper`) and reaps exactly the pids
  the runtime started for it (:func:`reap`), never ``waitpid(-1)``, which would steal exit
  statuses from asyncio's own child watchers;
- rlimits are never requested (root may lack ``CAP_SYS_RESOURCE``): see :mod:`.oci`.

Two things keep a runtime invocation cheap, each measured on the 2-core build machine: crun is
executed from a sealed in-memory copy of itself (:class:`SealedBinary`), so it skips re-copying
its own binary and re-executing itself on every call (its CVE-2019-5736 defence, which a sealed
copy satisfies: nobody can write to it), about 2.5 ms of CPU per call; and its compiled seccomp
program is reused through the ``run.oci.seccomp_bpf_data`` annotation instead of being compiled
by libseccomp on every start (:meth:`Crun.seccomp_annotation`), about 2 ms more.

This module imports only :mod:`sandlot.errors` and the standard library.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

from sandlot.errors import BackendError, BackendUnavailable

__all__ = [
    "ContainerState",
    "Crun",
    "Runsc",
    "Runtime",
    "SealedBinary",
    "become_subreaper",
    "ensure_hugetlb_hierarchy",
    "process_alive",
    "process_start_time",
    "reap",
    "wait_exit",
]

_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Make this process the reaper of orphans it started (idempotent)."""
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        msg = f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}"
        raise BackendError(msg)


def _proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name may hold spaces and parentheses; everything after the last ')' is
    # fixed fields starting with the state.
    return raw[raw.rindex(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None if it does not exist)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when given, started at ``start_time``."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


async def wait_exit(pid: int, start_time: int | None, timeout: float) -> bool:
    """Wait until the process exits (or becomes a zombie); True when it did within ``timeout``."""
    if not process_alive(pid, start_time):
        return True
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        # The pid could have been recycled between the check and pidfd_open.
        if not process_alive(pid, start_time):
            return True
        with anyio.move_on_after(timeout):
            await anyio.wait_readable(fd)
            return True
        return not process_alive(pid, start_time)
    finally:
        os.close(fd)


def reap(pid: int, start_time: int | None = None, *, timeout: float = 0.0) -> int | None:
    """Collect the exit status of a container process that was re-parented to us.

    Only waits on ``pid`` when it is our child and (if given) started at ``start_time``, so a
    recycled pid is never touched. Returns the raw wait status, or None when it was not ours
    to reap or did not exit within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        fields = _proc_stat(pid)
        if fields is None:
            return None
        if int(fields[1]) != os.getpid():
            return None
        if start_time is not None and int(fields[19]) != start_time:
            return None
        if fields[0] in ("Z", "X"):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return None
            if got == pid:
                return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.002)


def ensure_hugetlb_hierarchy() -> None:
    """Mount the cgroup v1 ``hugetlb`` hierarchy where a hybrid host lacks it (crun needs it).

    Raises:
        BackendUnavailable: the host is a hybrid one and the mount is impossible here.
    """
    cg = Path("/sys/fs/cgroup")
    if not (cg / "memory").is_dir() or not (cg / "unified").is_dir():
        return  # pure v1 or pure v2: crun copes
    target = cg / "hugetlb"
    with open("/proc/self/mountinfo") as f:
        if any(line.split(" ")[4] == str(target) for line in f):
            return
    with open("/proc/cgroups") as f:
        if not any(line.split("\t")[0] == "hugetlb" for line in f):
            return  # no such controller in this kernel: nothing for crun to trip on
    try:
        target.mkdir(exist_ok=True)
        subprocess.run(
            ["mount", "-t", "cgroup", "-o", "hugetlb", "cgroup", str(target)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (
            e.stderr.decode(errors="replace").strip()
            if isinstance(e, subprocess.CalledProcessError)
            else str(e)
        )
        msg = (
            "crun on this cgroup v1/v2 hybrid host needs the hugetlb hierarchy mounted and it "
            f"could not be: {detail}. As root run: mkdir -p {target} && "
            f"mount -t cgroup -o hugetlb cgroup {target}"
        )
        raise BackendUnavailable(msg) from e


@dataclass(frozen=True)
class ContainerState:
    """What the runtime says about one container."""

    status: str
    """``created``, ``running``, ``paused``, ``stopped``."""
    pid: int
    """Host pid of its init (0 when stopped)."""


def _spawn_wait(
    argv: Sequence[str],
    *,
    fd3: int | None,
    log: Path,
    exe: str | None = None,
    fd4: int | None = None,
) -> tuple[int, str]:
    """Run ``argv`` with stdout/stderr appended to ``log``, ``fd3`` as its fd 3 and ``fd4``
    as its fd 4.

    posix_spawn (not subprocess) because the listening socket must land exactly on fd 3 for
    ``--preserve-fds 1``, and posix_spawn can dup2 it there without a fork of this
    (multi-threaded) interpreter.
    """
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    start = os.lseek(log_fd, 0, os.SEEK_END)
    high: list[int] = []
    try:
        actions: list[tuple[int, ...] | tuple[int, int, str, int, int]] = [
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, log_fd, 1),
            (os.POSIX_SPAWN_DUP2, log_fd, 2),
        ]
        for fd, target in ((fd3, 3), (fd4, 4)):
            if fd is not None:
                # dup2 onto itself would keep close-on-exec; go through a spare number first.
                high.append(os.dup(fd))
                actions.append((os.POSIX_SPAWN_DUP2, high[-1], target))
        try:
            if exe is not None:
                pid = os.posix_spawn(exe, list(argv), dict(os.environ), file_actions=actions)
            else:
                pid = os.posix_spawnp(argv[0], list(argv), dict(os.environ), file_actions=actions)
        except FileNotFoundError as e:
            msg = f"{argv[0]} is not installed"
            raise BackendUnavailable(msg) from e
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(log_fd)
        for fd in high:
            os.close(fd)
    rc = os.waitstatus_to_exitcode(status)
    out = ""
    if rc != 0:
        with open(log, "rb") as f:
            f.seek(start)
            out = f.read()[-4000:].decode(errors="replace").strip()
    return rc, out


def _run(
    argv: Sequence[str], timeout: float = 60.0, exe: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            list(argv), capture_output=True, check=False, timeout=timeout, executable=exe
        )
    except FileNotFoundError as e:
        msg = f"{argv[0]} is not installed"
        raise BackendUnavailable(msg) from e
    except subprocess.TimeoutExpired as e:
        msg = f"{' '.join(argv[:4])} … did not finish in {timeout:.0f}s"
        raise BackendError(msg) from e


def _missing(err: str) -> bool:
    low = err.lower()
    return "does not exist" in low or "no such" in low or "not found" in low


_MFD_CLOEXEC = 0x1
_MFD_ALLOW_SEALING = 0x2
_MFD_EXEC = 0x10
_F_ADD_SEALS = 1033
_SEALS = 0x1 | 0x2 | 0x4 | 0x8  # SEAL, SHRINK, GROW, WRITE: what crun checks for


class SealedBinary:
    """A read-only, sealed in-memory copy of an executable, run as ``/proc/<pid>/fd/<n>``.

    crun defends against a container overwriting the host's binary through ``/proc/self/exe``
    (CVE-2019-5736) by copying itself to a sealed memfd and re-executing on every call, unless
    it already runs from one. Handing it that copy once keeps the defence (the copy cannot be
    written to by anyone) and saves an ``execve`` plus a bind mount per call. Where a copy
    cannot be made or executed (``vm.memfd_noexec``, an old kernel) the binary is run as is.
    The copy is of the binary found at first use; an upgrade on disk takes effect on the next
    backend object.
    """

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self._fd = -1
        self._failed = False
        self._digest = ""

    def path(self) -> str | None:
        """What to execute instead of the binary, or None to run the binary itself."""
        if self._fd < 0 and not self._failed:
            self._make()
        if self._fd < 0:
            return None
        # /proc/<our pid>, not /proc/self: the path is resolved by the child being spawned.
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def fd(self) -> int | None:
        """The descriptor of the copy (close-on-exec), or None without one."""
        if self._fd < 0 and not self._failed:
            self._make()
        return self._fd if self._fd >= 0 else None

    @property
    def digest(self) -> str:
        """SHA-256 of the binary's content ("" before the first :meth:`path` or without a
        copy)."""
        return self._digest

    def _make(self) -> None:
        found = shutil.which(self.binary)
        if found is None:
            self._failed = True
            return
        try:
            data = Path(found).read_bytes()
            try:
                fd = os.memfd_create(
                    f"sandlot-{self.binary}", _MFD_CLOEXEC | _MFD_ALLOW_SEALING | _MFD_EXEC
                )
            except OSError:
                # Kernels before 6.3 know no MFD_EXEC; their memfds are executable anyway.
                fd = os.memfd_create(f"sandlot-{self.binary}", _MFD_CLOEXEC | _MFD_ALLOW_SEALING)
        except OSError:
            self._failed = True
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            fcntl.fcntl(fd, _F_ADD_SEALS, _SEALS)
            probe = subprocess.run(
                [self.binary, "--version"],
                executable=f"/proc/{os.getpid()}/fd/{fd}",
                capture_output=True,
                check=False,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            os.close(fd)
            self._failed = True
            return
        if probe.returncode != 0:
            os.close(fd)
            self._failed = True
            return
        self._fd = fd
        self._digest = hashlib.sha256(data).hexdigest()

    def close(self) -> None:
        """Drop the copy (the next :meth:`path` makes a new one)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Runtime:
    """An OCI runtime CLI with its own state root."""

    name = "runtime"
    binary = "false"
    sealed = False
    """Run the binary from a :class:`SealedBinary` copy."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._copy = SealedBinary(self.binary) if self.sealed else None

    def _exe(self) -> str | None:
        return self._copy.path() if self._copy is not None else None

    def close(self) -> None:
        """Release what the runtime object holds (its sealed copy)."""
        if self._copy is not None:
            self._copy.close()

    def available(self) -> str | None:
        """None when usable here, else what is missing (naming the Debian package)."""
        if shutil.which(self.binary) is None:
            return f"{self.binary} is not installed (Debian package {self.binary})"
        return None

    def _base(self) -> list[str]:
        return [self.binary, "--root", str(self.root)]

    def _run_argv(
        self, name: str, bundle: Path, *, listen_fd: bool, pid_file: Path, network: bool
    ) -> list[str]:
        raise NotImplementedError

    async def run(
        self,
        name: str,
        bundle: Path,
        *,
        listen_fd: int | None,
        log: Path,
        pid_file: Path,
        network: bool = False,
        wrapper: Sequence[str] | None = None,
    ) -> None:
        """Create and start ``name`` from ``bundle`` detached; its init gets ``listen_fd`` as 3
        and its host pid is written to ``pid_file``. ``network``: the bundle joins a prepared
        network namespace whose interfaces the sandbox should use. ``wrapper``: a command that
        sets the stage and then executes the runtime's command line given after ``--exe PATH
        --`` (the rootless user-namespace helper)."""
        argv = self._run_argv(
            name, bundle, listen_fd=listen_fd is not None, pid_file=pid_file, network=network
        )
        exe = self._exe()
        fd4 = None
        if wrapper is not None:
            # The wrapper runs the runtime from another user namespace, where our /proc/<pid>
            # is out of reach: it gets the sealed copy as its fd 4 instead. It also collects
            # the runtime's exited helpers, which would otherwise be zombies of ours.
            fd4 = self._copy.fd() if self._copy is not None else None
            extra = ["--exe-fd", "4"] if fd4 is not None else []
            argv = [*wrapper, *extra, "--reap", "1", "--", *argv]
            exe = None
        for attempt in range(2):
            rc, out = await anyio.to_thread.run_sync(
                lambda: _spawn_wait(argv, fd3=listen_fd, log=log, exe=exe, fd4=fd4)
            )
            # Another process may remove an empty parent cgroup just as the runtime makes
            # its directory below it (the runtime makes them one level at a time): once more.
            if rc == 0 or attempt or not ("cgroup" in out and "No such file" in out):
                break
        if rc != 0:
            msg = f"{self.name} could not start sandbox {name}: {out or f'exit {rc}'}"
            raise BackendError(msg)

    async def state(self, name: str) -> ContainerState | None:
        """The container's state, or None when the runtime has no such container."""
        exe = self._exe()
        proc = await anyio.to_thread.run_sync(lambda: _run([*self._base(), "state", name], exe=exe))
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace")
            if _missing(err):
                return None
            msg = f"{self.name} state {name}: {err.strip()}"
            raise BackendError(msg)
        try:
            doc = json.loads(proc.stdout)
        except ValueError as e:
            msg = f"{self.name} state {name}: unreadable answer"
            raise BackendError(msg) from e
        return ContainerState(str(doc.get("status", "")), int(doc.get("pid") or 0))

    async def kill(self, name: str, sig: int) -> None:
        """Signal the container's init (a container that already stopped is fine)."""
        exe = self._exe()
        await anyio.to_thread.run_sync(
            lambda: _run(
                [*self._base(), "kill", name, signal.Signals(sig).name.removeprefix("SIG")],
                exe=exe,
            )
        )

    async def delete(self, name: str, known: Sequence[tuple[int, int]] | None = None) -> None:
        """Remove the container, killing whatever of it is left; a missing one is fine.

        The runtime may drop its state yet leave processes behind (runsc gives up waiting for
        a sandbox after a deadline), so the host processes it reported are killed afterwards.
        ``known``: the container's host processes as ``(pid, start time)`` when the caller
        recorded them at boot, which spares asking the runtime first.
        """
        if not self.has(name):
            return
        if known is None:
            state = await self.state(name)
            leftovers = [
                (pid, start)
                for pid in self.host_pids(name, state.pid if state else 0)
                if (start := process_start_time(pid)) is not None
            ]
        else:
            leftovers = [(pid, start) for pid, start in known if process_start_time(pid) == start]
        exe = self._exe()
        proc = await anyio.to_thread.run_sync(lambda: _run(self._delete_argv(name), exe=exe))
        for pid, start in leftovers:
            if process_alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if leftovers:
            # They may have been re-parented to us (we are a subreaper): collect them.
            await anyio.to_thread.run_sync(
                lambda: [reap(pid, start, timeout=1.0) for pid, start in leftovers]
            )
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            if _missing(err) or await self.state(name) is None:
                return
            msg = f"{self.name} delete {name}: {err}"
            raise BackendError(msg)

    def _delete_argv(self, name: str) -> list[str]:
        return [*self._base(), "delete", "-f", name]

    async def pause(self, name: str) -> None:
        """Freeze every process of the container."""
        await self._simple("pause", name)

    async def resume(self, name: str) -> None:
        """Thaw a paused container."""
        await self._simple("resume", name)

    async def _simple(self, verb: str, name: str) -> None:
        exe = self._exe()
        proc = await anyio.to_thread.run_sync(lambda: _run([*self._base(), verb, name], exe=exe))
        if proc.returncode != 0:
            msg = f"{self.name} {verb} {name}: {proc.stderr.decode(errors='replace').strip()}"
            raise BackendError(msg)

    def recorded_state(self, name: str) -> ContainerState | None:
        """The container's state from the runtime's own record, without running the runtime;
        None when this runtime keeps no readable record (ask :meth:`state`)."""
        return None

    async def inside_pids(self, name: str) -> list[int] | None:
        """Process ids inside the container as the runtime sees them, or None when the caller
        should count them on the host (the container's cgroup)."""
        return None

    def names(self) -> list[str]:
        """Containers in this runtime's state root."""
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir())
        except FileNotFoundError:
            return []

    def has(self, name: str) -> bool:
        """Whether the runtime keeps state for ``name``.

        One ``stat`` rather than :meth:`names`: every boot and delete asks, and listing the
        state root of a hundred sandboxes each time made forking them quadratic.
        """
        return (self.root / name).is_dir()

    def host_pids(self, name: str, init_pid: int) -> list[int]:
        """Host processes of the container that may be re-parented to us (to reap later)."""
        return [init_pid] if init_pid > 0 else []


class Crun(Runtime):
    """``crun``: namespaces, cgroups and seccomp applied by the host kernel.

    ``rootless``: the caller is a normal user without delegated cgroups, so crun runs with its
    cgroup manager disabled (it would otherwise fail making a cgroup, or, run as root of a user
    namespace, believe it could).
    """

    name = "crun"
    binary = "crun"
    sealed = True

    def __init__(self, root: Path, *, rootless: bool = False) -> None:
        super().__init__(root)
        self.rootless = rootless
        self._bpf: dict[str, str] = {}

    def _base(self) -> list[str]:
        base = super()._base()
        if self.rootless:
            base.insert(1, "--cgroup-manager=disabled")
        return base

    def available(self) -> str | None:
        missing = super().available()
        if missing is None and not self.rootless:
            try:
                ensure_hugetlb_hierarchy()
            except BackendUnavailable as e:
                return e.message
        return missing

    def recorded_state(self, name: str) -> ContainerState | None:
        """The state from crun's ``status`` record and ``/proc``, as ``crun state`` derives it:
        ``created`` while the exec FIFO exists, else ``running`` while the recorded init (pid
        and start time) lives, else ``stopped``. A frozen container reads as running."""
        try:
            doc = json.loads((self.root / name / "status").read_text())
            pid = int(doc["pid"])
            start = int(doc["process-start-time"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not process_alive(pid, start):
            return ContainerState("stopped", 0)
        if (self.root / name / "exec.fifo").exists():
            return ContainerState("created", pid)
        return ContainerState("running", pid)

    async def delete(self, name: str, known: Sequence[tuple[int, int]] | None = None) -> None:
        """Remove the container (see :meth:`Runtime.delete`).

        When every recorded process of the container is gone, this does what ``crun delete``
        does for a stopped container itself (remove its now empty cgroups and its state
        directory), which spares a runtime run on every stop, reset and destroy; anything
        unexpected (a live process, a busy cgroup, an unreadable record) leaves the work to
        ``crun delete -f``.
        """
        if known is not None and await anyio.to_thread.run_sync(self._remove_stopped, name, known):
            return
        await super().delete(name, known)

    def _remove_stopped(self, name: str, known: Sequence[tuple[int, int]]) -> bool:
        if any(process_alive(pid, start) for pid, start in known):
            return False
        state_dir = self.root / name
        try:
            doc = json.loads((state_dir / "status").read_text())
            cgroup = str(doc["cgroup-path"]).strip("/")
            pid = int(doc["pid"])
            start = int(doc["process-start-time"])
        except FileNotFoundError:
            return not state_dir.exists()
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if (not cgroup and not self.rootless) or process_alive(pid, start):
            return False
        base = Path("/sys/fs/cgroup")
        roots = [base, *(p for p in base.iterdir() if p.is_dir() and not p.is_symlink())]
        if not cgroup:
            roots = []  # rootless: crun made no cgroup
        for root in roots:
            target = root / cgroup
            if not (target / "cgroup.procs").exists():
                continue
            try:
                if (target / "cgroup.procs").read_text().strip():
                    return False
                target.rmdir()
            except FileNotFoundError:
                continue
            except OSError:
                return False
        shutil.rmtree(state_dir, ignore_errors=True)
        return not state_dir.exists()

    def _profile_key(self, profile: object) -> str:
        raw = json.dumps(profile, sort_keys=True, separators=(",", ":")).encode()
        binary = self._copy.digest if self._copy is not None else ""
        return hashlib.sha256(raw + b"\0" + binary.encode()).hexdigest()[:32]

    def seccomp_annotation(self, profile: object) -> dict[str, str]:
        """``run.oci.seccomp_bpf_data`` for ``profile`` when crun compiled it before (else {}).

        The program is the one this very crun binary produced from the same profile (the key
        covers both), read back from the state of an earlier container, so the filter a
        sandbox gets is unchanged; only libseccomp's compilation is skipped.
        """
        self._exe()  # the key needs the binary's digest
        key = self._profile_key(profile)
        if key not in self._bpf:
            try:
                raw = (self.root.parent / f"seccomp-{key}.bpf").read_bytes()
            except OSError:
                return {}
            self._bpf[key] = base64.b64encode(raw).decode()
        return {"run.oci.seccomp_bpf_data": self._bpf[key]}

    def learn_seccomp(self, name: str, profile: object) -> None:
        """Keep the program crun compiled for container ``name`` (started from ``profile``
        without the annotation) for later bundles."""
        self._exe()
        key = self._profile_key(profile)
        if key in self._bpf:
            return
        try:
            data = (self.root / name / "seccomp.bpf").read_bytes()
        except OSError:
            return
        # A classic BPF program is a whole number of 8-byte instructions.
        if not data or len(data) % 8:
            return
        dest = self.root.parent / f"seccomp-{key}.bpf"
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
        with contextlib.suppress(OSError):
            tmp.write_bytes(data)
            tmp.replace(dest)
        self._bpf[key] = base64.b64encode(data).decode()

    def _run_argv(
        self, name: str, bundle: Path, *, listen_fd: bool, pid_file: Path, network: bool
    ) -> list[str]:
        argv = [*self._base(), "run", "-d", "--pid-file", str(pid_file), "--bundle", str(bundle)]
        if listen_fd:
            argv += ["--preserve-fds", "1"]
        return [*argv, name]


class Runsc(Runtime):
    """``runsc`` (gVisor): the sandbox's system calls go to a user-space kernel.

    Debian's runsc (2022-12) has the old command line: ``--detach`` and ``delete -force``; only
    the ``ptrace`` platform works on hosts without usable KVM.
    """

    name = "runsc"
    binary = "runsc"

    def _base(self) -> list[str]:
        return [
            self.binary,
            "--root",
            str(self.root),
            "--platform=ptrace",
            # The agent binds its socket on a host directory mounted in; only "create" is
            # granted, never "open", so the sandbox cannot reach host sockets.
            "--host-uds=create",
            # Apply the bundle's seccomp profile inside the sandbox too, so the same calls fail
            # under both runtimes.
            "--oci-seccomp",
        ]

    def _run_argv(
        self, name: str, bundle: Path, *, listen_fd: bool, pid_file: Path, network: bool
    ) -> list[str]:
        # "sandbox": gVisor's own network stack drives the interfaces of the namespace the
        # bundle joins; "none": loopback only.
        return [
            *self._base(),
            f"--network={'sandbox' if network else 'none'}",
            "run",
            "--detach",
            "-pid-file",
            str(pid_file),
            "--bundle",
            str(bundle),
            name,
        ]

    def _delete_argv(self, name: str) -> list[str]:
        return [*self._base(), "delete", "-force", name]

    async def inside_pids(self, name: str) -> list[int] | None:
        """Process ids in gVisor's own kernel (``runsc ps``); the host cgroup holds only the
        sentry and the gofer."""
        proc = await anyio.to_thread.run_sync(
            lambda: _run([*self._base(), "ps", "--format=json", name])
        )
        if proc.returncode != 0:
            msg = f"runsc ps {name}: {proc.stderr.decode(errors='replace').strip()}"
            raise BackendError(msg)
        try:
            doc = json.loads(proc.stdout or b"[]")
        except ValueError as e:
            msg = f"runsc ps {name}: unreadable answer"
            raise BackendError(msg) from e
        # This runsc prints a list of pids; newer ones print process objects.
        pids = []
        for item in doc if isinstance(doc, list) else []:
            if isinstance(item, int):
                pids.append(item)
            elif isinstance(item, dict):
                pids.append(int(item.get("PID") or item.get("pid") or 0))
        return sorted(pids)

    def names(self) -> list[str]:
        out = set()
        with contextlib.suppress(FileNotFoundError):
            for p in self.root.iterdir():
                # runsc keeps "<sandbox>_sandbox:<container>.state" and ".lock" files.
                base = p.name.split("_sandbox:")[0].removesuffix(".state").removesuffix(".lock")
                if base and not base.startswith("."):
                    out.add(base)
        return sorted(out)

    def has(self, name: str) -> bool:
        # runsc's records are files named after the sandbox, not one directory per container.
        return name in self.names()

    def host_pids(self, name: str, init_pid: int) -> list[int]:
        # runsc leaves a sandbox (sentry) process and a gofer; both are re-parented to us.
        pids = [init_pid] if init_pid > 0 else []
        for path in self.root.glob(f"*{name}*.state"):
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads(path.read_text())
                pids.extend(
                    doc[key]
                    for key in ("GoferPid", "goferPid")
                    if isinstance(doc.get(key), int) and doc[key] > 0
                )
                sandbox = doc.get("Sandbox") or doc.get("sandbox") or {}
                if isinstance(sandbox, dict):
                    pid = sandbox.get("Pid") or sandbox.get("pid")
                    if isinstance(pid, int) and pid > 0:
                        pids.append(pid)
        return sorted(set(pids))
