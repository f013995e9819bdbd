"""Every program decided: the host side of seccomp user notification for ``execve``.

In ``strict`` enforcement the sandbox's seccomp profile answers ``execve`` and ``execveat`` with
``SCMP_ACT_NOTIFY``: the calling thread stops in the kernel, and whoever holds the filter's
notify fd decides. crun hands that fd over a unix socket (the OCI ``linux.seccomp.listenerPath``)
with ``SCM_RIGHTS``, together with the OCI state as JSON. :class:`ExecGate` owns that socket and
a thread that, for each notification, reads the program's path, its argv (with
``process_vm_readv``, at the pointers in the syscall's arguments) and its working directory, asks an
injected ``decide(path, argv, cwd) -> bool``, and answers the kernel: continue the call, or fail
it with ``EPERM``. The module knows nothing of policy, receipts or the Manager.

Fail closed: a notification that cannot be read (an unknown architecture, an unreadable pointer,
an argv past :data:`MAX_ARGS` or :data:`MAX_BYTES`) or a ``decide`` that raises is a deny.
An ``execve`` of an absolute path that names nothing inside the caller's root (:func:`absent`:
a shell trying each ``PATH`` entry) is failed with ``ENOENT``, as the kernel would fail it,
without asking ``decide``: nothing can run either way.

The race it cannot close (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``, seccomp_unotify(2)): the kernel
reads the path and argv again after the answer, so another thread of the caller (or any task
sharing its memory) can rewrite them between the two reads. :func:`shares_memory` tells whether
the caller could have such a partner, for callers that want to refuse that case.

This module imports nothing from sandlot.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import final

__all__ = [
    "MAX_ARGS",
    "MAX_BYTES",
    "ExecCall",
    "ExecGate",
    "absent",
    "notif_sizes",
    "read_exec_call",
    "shares_memory",
]

MAX_ARGS = 4096
"""The most argv entries read; a longer argv is denied rather than decided on a prefix."""
MAX_BYTES = 1 << 20
"""The most bytes of path plus argv read."""

# <linux/seccomp.h>; ioctl numbers are _IOWR('!', n, struct) / _IOW('!', 2, __u64).
_SECCOMP_GET_NOTIF_SIZES = 3
_NOTIF_RECV = 0xC0502100
_NOTIF_SEND = 0xC0182101
_NOTIF_ID_VALID = 0x40082102
_FLAG_CONTINUE = 1
_NR_SECCOMP = 317  # x86-64
_NR_OPENAT2 = 437
_RESOLVE_IN_ROOT = 0x10
_OPEN_HOW = struct.Struct("=QQQ")  # flags, mode, resolve

_AUDIT_ARCH_X86_64 = 0xC000003E
_AUDIT_ARCH_I386 = 0x40000003
_X32_BIT = 0x40000000
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000

# (arch, nr) -> (pointer width, index of the path argument, index of argv, is execveat)
_EXEC_CALLS: dict[tuple[int, int], tuple[int, int, int, bool]] = {
    (_AUDIT_ARCH_X86_64, 59): (8, 0, 1, False),
    (_AUDIT_ARCH_X86_64, 322): (8, 1, 2, True),
    (_AUDIT_ARCH_X86_64, _X32_BIT | 520): (4, 0, 1, False),
    (_AUDIT_ARCH_X86_64, _X32_BIT | 545): (4, 1, 2, True),
    (_AUDIT_ARCH_I386, 11): (4, 0, 1, False),
    (_AUDIT_ARCH_I386, 358): (4, 1, 2, True),
}

_EXECVE = frozenset(key for key, shape in _EXEC_CALLS.items() if not shape[3])
"""The plain ``execve`` numbers: an ``execveat`` path may be relative to a directory fd, whose
name as the host reads it means nothing inside the caller's root."""

_NOTIF = struct.Struct("=QIIiIQ6Q")  # id, pid, flags, data{nr, arch, ip, args[6]}
_RESP = struct.Struct("=QqiI")  # id, val, error, flags
_ID = struct.Struct("=Q")
_POINTER = {8: struct.Struct("=Q"), 4: struct.Struct("=I")}

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_ioctl = _libc.ioctl
_ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_ioctl.restype = ctypes.c_int


def notif_sizes() -> tuple[int, int, int]:
    """The kernel's sizes of ``seccomp_notif``, ``seccomp_notif_resp`` and ``seccomp_data``."""
    buf = ctypes.create_string_buffer(6)
    if _syscall(_NR_SECCOMP, _SECCOMP_GET_NOTIF_SIZES, 0, buf) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    sizes = struct.unpack("=HHH", buf.raw)
    return sizes[0], sizes[1], sizes[2]


@final
@dataclass(frozen=True)
class ExecCall:
    """One stopped ``execve``/``execveat``, as read from outside the caller."""

    pid: int
    """The calling thread, in the notifier's pid namespace."""
    path: str
    """The program as the caller named it (for ``execveat``, joined to the directory of its fd;
    for ``AT_EMPTY_PATH``, the target of the fd)."""
    argv: tuple[str, ...]
    cwd: str
    """The caller's working directory as the host sees it (``/proc/PID/cwd``)."""


def _ioctl_checked(fd: int, request: int, buf: ctypes.Array[ctypes.c_char]) -> None:
    # ctypes releases the GIL around the call, so a blocking RECV stalls only its own thread.
    if _ioctl(fd, request, ctypes.addressof(buf)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_process_vm_readv.restype = ctypes.c_ssize_t

_PAGE = 4096
_PAGE_MASK = ~(_PAGE - 1)


@final
class _Memory:
    """Another process's memory by whole pages, each read once, the pages one step of the
    parse needs in one ``process_vm_readv``: the path and the argv array together, then every
    argv string at once (none when they sit on pages already read, as they usually do). One
    or two system calls for a usual exec, where ``/proc/PID/mem`` took an open, a read per page
    and a close.

    ``process_vm_readv`` needs the same ptrace access as ``/proc/PID/mem`` and, unlike it,
    honours page protections, as the kernel's own copy of the strings at ``execve`` does: a
    page it cannot read is one the exec would fail on (``EFAULT``), so it is a deny.

    One per serving thread: the buffers are reused from call to call (no allocation of them
    on the path every exec waits on).
    """

    SLOTS = 32

    def __init__(self) -> None:
        self.pid = 0
        self.pages: dict[int, bytes] = {}
        self._buf = ctypes.create_string_buffer(self.SLOTS * _PAGE)
        self._view = memoryview(self._buf).cast("B")
        # struct iovec arrays as (base, length) pairs of size_t
        self._local = (ctypes.c_size_t * 2)(ctypes.addressof(self._buf), 0)
        self._remote = (ctypes.c_size_t * (2 * self.SLOTS))(*(0, _PAGE) * self.SLOTS)

    def reset(self, pid: int) -> None:
        self.pid = pid
        self.pages.clear()

    def fetch(self, addrs: Iterable[int]) -> None:
        """Read the pages holding ``addrs`` that are not read yet.

        Raises:
            OSError: One of them cannot be read (``EFAULT``), or the process is gone.
        """
        pages = self.pages
        wanted = {a & _PAGE_MASK for a in addrs}
        wanted.difference_update(pages)
        if not wanted:  # the usual second step: the strings sit on pages already read
            return
        bases = sorted(wanted)
        remote = self._remote
        for at in range(0, len(bases), self.SLOTS):
            batch = bases[at : at + self.SLOTS]
            for i, base in enumerate(batch):
                remote[2 * i] = base
            want = len(batch) * _PAGE
            self._local[1] = want
            got = _process_vm_readv(self.pid, self._local, 1, remote, len(batch), 0)
            if got < 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e))
            view = self._view
            for i in range(got // _PAGE):
                pages[batch[i]] = view[i * _PAGE : (i + 1) * _PAGE].tobytes()
            if got != want:  # a transfer stops at the first page it cannot read
                raise OSError(errno.EFAULT, "unreadable memory")

    def page(self, addr: int) -> tuple[bytes, int]:
        """The page holding ``addr`` and the offset of ``addr`` in it."""
        base = addr & _PAGE_MASK
        data = self.pages.get(base)
        if data is None:
            self.fetch((addr,))
            data = self.pages[base]
        return data, addr - base

    def cstring(self, addr: int, limit: int) -> bytes:
        data, at = self.page(addr)
        end = data.find(b"\0", at, at + limit)
        if end >= 0:  # the usual case: the whole string in one page
            return data[at:end]
        out = bytearray()
        while len(out) < limit:
            data, at = self.page(addr)
            chunk = data[at : at + limit - len(out)]
            end = chunk.find(b"\0")
            if end >= 0:
                out += chunk[:end]
                return bytes(out)
            out += chunk
            addr += len(chunk)
        raise OSError(errno.E2BIG, "string too long")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def read_exec_call(
    pid: int, nr: int, arch: int, args: tuple[int, ...], memory: _Memory | None = None
) -> ExecCall:
    """Read the program, argv and cwd of a stopped exec call.

    Args:
        memory: A reader to reuse (the serving thread's own); a new one if None.

    Raises:
        OSError: Not an exec call this module knows, or memory that cannot be read.
    """
    mem = memory if memory is not None else _Memory()
    mem.reset(pid)
    raw_path = _read_path(mem, nr, arch, args)
    return _read_rest(mem, nr, arch, args, raw_path)


def _read_path(mem: _Memory, nr: int, arch: int, args: tuple[int, ...]) -> bytes:
    """The path as the caller passed it; the page of the argv array is read with it."""
    shape = _EXEC_CALLS.get((arch, nr))
    if shape is None:
        raise OSError(errno.ENOSYS, f"not an exec call: arch {arch:#x} nr {nr}")
    width, path_at, argv_at, _ = shape
    mask = (1 << (8 * width)) - 1
    path_addr = args[path_at] & mask
    slot = args[argv_at] & mask
    mem.fetch((path_addr, slot) if slot else (path_addr,))
    return mem.cstring(path_addr, MAX_BYTES)


def _read_rest(
    mem: _Memory, nr: int, arch: int, args: tuple[int, ...], raw_path: bytes
) -> ExecCall:
    """The whole call, once :func:`_read_path` has read its path."""
    width, _, argv_at, is_at = _EXEC_CALLS[(arch, nr)]
    pid = mem.pid
    slot = args[argv_at] & ((1 << (8 * width)) - 1)
    budget = MAX_BYTES - len(raw_path) - 1
    pointer = _POINTER[width]
    pointers: list[int] = []
    data, at = mem.page(slot) if slot else (b"", 0)
    while slot:  # a NULL argv is an empty one (Linux accepts it)
        if len(pointers) >= MAX_ARGS:
            raise OSError(errno.E2BIG, "argv too long")
        if at + width > _PAGE:  # across two pages: only a misaligned array (which Linux takes)
            data, at = data[at:] + mem.page(slot - at + _PAGE)[0][: width - _PAGE + at], 0
        (ptr,) = pointer.unpack_from(data, at)
        if ptr == 0:
            break
        pointers.append(ptr)
        slot += width
        at += width
        if at >= len(data):
            data, at = mem.page(slot)
    mem.fetch(pointers)
    argv: list[str] = []
    for ptr in pointers:
        arg = mem.cstring(ptr, budget)
        budget -= len(arg) + 1
        argv.append(_decode(arg))
    # os.readlink: Path.readlink costs five times as much, on the path every exec waits on.
    cwd = os.readlink(f"/proc/{pid}/cwd")  # noqa: PTH115
    path = _decode(raw_path)
    if is_at:
        dirfd = ctypes.c_int32(args[0] & 0xFFFFFFFF).value
        if not path and args[4] & _AT_EMPTY_PATH:
            path = str(Path(f"/proc/{pid}/fd/{dirfd}").readlink())
        elif not path.startswith("/") and dirfd != _AT_FDCWD:
            path = str(Path(f"/proc/{pid}/fd/{dirfd}").readlink() / path)
    return ExecCall(pid=pid, path=path, argv=tuple(argv), cwd=cwd)


def absent(pid: int, path: str) -> bool:
    """Whether the absolute ``path`` names nothing inside the root of process ``pid``: its
    ``execve`` would fail with ``ENOENT``, so failing it so from outside lets nothing run.

    Resolved with ``openat2`` and ``RESOLVE_IN_ROOT`` from the process's root (an absolute
    symlink inside stays inside, as it does for the process). A file made between this look
    and the answer makes no difference: the call is answered ``ENOENT`` and never continues.
    False whenever that cannot be told (a relative path, the process gone, another error).
    """
    if not path.startswith("/"):
        return False
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        how = _OPEN_HOW.pack(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT)
        fd = _syscall(_NR_OPENAT2, root, os.fsencode(path), how, len(how))
        if fd >= 0:
            os.close(fd)
            return False
        return ctypes.get_errno() == errno.ENOENT
    finally:
        os.close(root)


def shares_memory(pid: int) -> bool:
    """Whether another task could write the memory of thread ``pid`` (the race above).

    True when its process has more than one thread. A ``CLONE_VM`` child that is not a thread
    (``vfork``, ``posix_spawn``) shares its parent's memory too; its parent is suspended until
    the exec, but the parent's other threads are not, so the parent's thread count is checked
    as well.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    if int(fields.get("Threads", "1")) > 1:
        return True
    ppid = int(fields.get("PPid", "0"))
    if ppid <= 0:
        return False
    try:
        parent = Path(f"/proc/{ppid}/status").read_text()
    except OSError:
        return False
    return any(
        line.startswith("Threads:") and int(line.split()[1]) > 1 for line in parent.splitlines()
    )


Decide = Callable[[ExecCall], bool]
Quick = Callable[[ExecCall], bool | None]


@final
class _Listener:
    """One notify fd, closed under its lock so that a late answer never reaches a reused fd
    number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.closed = False
        # Filled under the lock: one pair serves the reading thread and the deciding ones.
        self._ident = ctypes.create_string_buffer(_ID.size)
        self._send = ctypes.create_string_buffer(_RESP.size)

    def answer(self, notif_id: int, *, allow: bool, error: int = errno.EPERM) -> bool:
        """Send the answer (a refusal fails the call with ``error``); False if the call is
        gone (its caller died) or the fd is closed."""
        ident, send = self._ident, self._send
        with self.lock:
            if self.closed:
                return False
            _ID.pack_into(ident, 0, notif_id)
            _RESP.pack_into(
                send, 0, notif_id, 0, 0 if allow else -error, _FLAG_CONTINUE if allow else 0
            )
            # Checked after the caller's memory was read: had it died and its pid been
            # reused, what was read belongs to another process, and no answer may be sent.
            try:
                _ioctl_checked(self.fd, _NOTIF_ID_VALID, ident)
                _ioctl_checked(self.fd, _NOTIF_SEND, send)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
                return False
        return True

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)


@final
class ExecGate:
    """A listener socket for crun and the thread that answers one container's exec calls.

    Lifecycle: construct (binds and listens at ``listener_path``), run ``crun`` (it connects and
    sends the notify fd; the first exec of the container waits for the answer), :meth:`close` at
    stop. Each fd is served until the last task under its filter exits (the fd hangs up); the
    socket keeps listening for the next start until :meth:`close`.

    Args:
        listener_path: The unix socket path written into the OCI config.
        decide: Called for each exec call; True allows it. It may block (the caller stays
            stopped meanwhile); an exception denies.
        quick: The fast path (a cache): called first, on the thread that reads the calls;
            True or False answers at once, None hands the call to ``decide`` on one of
            ``workers`` threads, so that a slow decision (a policy engine, an approval) does
            not hold up the sandbox's other calls. Without it, ``decide`` runs on the reading
            thread, one call at a time.
        workers: The most decisions made at once, with ``quick``.
    """

    def __init__(
        self,
        listener_path: str | os.PathLike[str],
        decide: Decide,
        *,
        quick: Quick | None = None,
        workers: int = 8,
    ) -> None:
        self.listener_path = os.fspath(listener_path)
        listener = Path(self.listener_path)
        self._decide = decide
        self._quick = quick
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.unlink(missing_ok=True)
        self._server.bind(self.listener_path)
        listener.chmod(0o600)
        self._server.listen(4)
        self.state: dict[str, object] | None = None
        """The OCI state crun sent with the fd, once it has."""
        self._missing: set[bytes] = set()
        """Paths lately found absent (each is looked up again before it is answered)."""
        self.decided = 0
        """How many exec calls were answered (allowed or denied)."""
        self._serving: list[threading.Thread] = []
        self._thread = threading.Thread(
            target=self._run, name=f"execgate:{self.listener_path}", daemon=True
        )
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close the socket and the notify fd.

        Exec calls still pending when the notify fd closes fail with ``ENOSYS`` in the caller
        (the kernel's answer when no listener remains), so closing never lets a call through.
        """
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        self._thread.join(timeout)
        for serving in self._serving:
            serving.join(timeout)
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            # Decisions still running answer nothing: their listener is closed by now.
            pool.shutdown(wait=False, cancel_futures=True)
        for close in (self._server.close, lambda: os.close(self._stop_r)):
            with contextlib.suppress(OSError):
                close()
        with contextlib.suppress(OSError):
            os.close(self._stop_w)
        Path(self.listener_path).unlink(missing_ok=True)

    def _poller(self, fd: int) -> select.poll:
        poller = select.poll()
        poller.register(self._stop_r, select.POLLIN)
        poller.register(fd, select.POLLIN)
        return poller

    def _stopping(self, fd: int, poller: select.poll | None = None) -> bool:
        """Wait until ``fd`` is readable; True when asked to stop or ``fd`` hung up."""
        poller = poller or self._poller(fd)
        while True:
            events = dict(poller.poll())
            if self._stop_r in events:
                return True
            if fd in events:
                return not events[fd] & select.POLLIN

    def _run(self) -> None:
        # One connection per filter: crun connects at each start of the container (and at
        # each ``crun exec``, whose process gets a filter of its own); each fd is served on
        # its own thread until its last task exits.
        while True:
            try:
                if self._stopping(self._server.fileno()):
                    return
                fd = self._receive_fd()
            except OSError:
                return
            if fd is None:
                continue
            serving = threading.Thread(
                target=self._serve_and_close, args=(fd,), name=self._thread.name, daemon=True
            )
            self._serving.append(serving)
            serving.start()

    def _serve_and_close(self, fd: int) -> None:
        listener = _Listener(fd)
        try:
            self._serve(listener)
        except OSError:
            pass
        finally:
            listener.close()

    def _receive_fd(self) -> int | None:
        conn, _ = self._server.accept()
        with conn:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
            chunks = [data]
            while data:
                data = conn.recv(1 << 16)
                chunks.append(data)
        if not fds:
            return None
        for extra in fds[1:]:
            os.close(extra)
        with contextlib.suppress(ValueError):
            self.state = json.loads(b"".join(chunks))
        os.set_inheritable(fds[0], False)
        return fds[0]

    def _serve(self, listener: _Listener) -> None:
        fd = listener.fd
        recv = ctypes.create_string_buffer(_NOTIF.size)
        memory = _Memory()
        # Not SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (Linux 6.6): measured on a 2-core VM, it
        # added 20-45 µs p50 per exec (both threads then share one CPU, the other idles).
        poller = self._poller(fd)
        while not self._stopping(fd, poller):
            ctypes.memset(recv, 0, _NOTIF.size)  # RECV refuses a buffer that is not zeroed
            try:
                _ioctl_checked(fd, _NOTIF_RECV, recv)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: the caller died first
                    continue
                raise
            notif_id, pid, _flags, nr, arch, _ip, *args = _NOTIF.unpack_from(recv)
            memory.reset(pid)
            plain = (arch, nr) in _EXECVE
            try:
                raw_path = _read_path(memory, nr, arch, tuple(args))
                if plain and raw_path in self._missing and absent(pid, _decode(raw_path)):
                    # A PATH entry that held nothing the last time either: answered before
                    # argv and cwd are read, for the shells that try several on each start.
                    listener.answer(notif_id, allow=False, error=errno.ENOENT)
                    self.decided += 1
                    continue
                call: ExecCall | None = _read_rest(memory, nr, arch, tuple(args), raw_path)
            except (OSError, ValueError):
                call = None
            allow: bool | None = False
            if call is not None and self._quick is not None:
                try:
                    allow = self._quick(call)
                except Exception:  # any failure of the decision is a deny, never a crash
                    allow = False
            elif call is not None:
                allow = None
            if allow is None and call is not None and plain and absent(pid, call.path):
                # A shell or execvp trying each PATH entry: answered as the kernel would,
                # with nothing to decide (and no receipt for a program that is not there).
                listener.answer(notif_id, allow=False, error=errno.ENOENT)
                if len(self._missing) >= 1024:  # a bound, not an eviction policy
                    self._missing.clear()
                self._missing.add(raw_path)
            elif allow is None and call is not None:
                if self._quick is None:
                    listener.answer(notif_id, allow=self._decided(call))
                else:
                    self._pool_for().submit(self._decide_later, listener, notif_id, call)
                    continue
            else:
                listener.answer(notif_id, allow=bool(allow))
            self.decided += 1

    def _pool_for(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="execgate")
            return self._pool

    def _decide_later(self, listener: _Listener, notif_id: int, call: ExecCall) -> None:
        allow = self._decided(call)
        with contextlib.suppress(OSError):
            listener.answer(notif_id, allow=allow)
        self.decided += 1

    def _decided(self, call: ExecCall) -> bool:
        try:
            return bool(self._decide(call))
        except Exception:  # any failure of the decision is a deny, never a crash
            return False
