#!/usr/bin/env python3
"""sandlot-agent: the program that runs inside a sandbox and does what the host asks.

It runs commands (streamed output, stdin, timeouts that kill the whole process tree), holds
background processes and terminals, and reads and writes files, all from inside the sandbox so
that paths resolve in the sandbox's own mount namespace. It speaks the multiplexed binary
protocol of ``docs/agent-protocol.md`` over a unix socket, a character device (virtio-serial) or
stdio, and serves many requests at once on one byte stream.

Constraints that shape this file (why it looks the way it does):

- It is copied alone into images: it imports only the standard library, nothing from sandlot,
  and must run on CPython 3.8 or newer (so no ``match``, no ``X | Y`` outside annotations, no
  3.9+ helpers such as ``str.removeprefix`` or ``os.waitstatus_to_exitcode``).
- It is started per sandbox and its startup is on the critical path of "create -> first
  exec", so it avoids the modules that cost milliseconds to import (``json``, ``subprocess``,
  ``socket``, ``signal``, ``selectors``, ``argparse``, ``enum`` via ``re``) and uses the C
  modules beneath them (``_json``, ``_socket``, ``_signal``, ``select.epoll``) and
  ``os.posix_spawn``. Rarely used modules are imported where they are used.
- It may be PID 1 of a pid namespace, so it reaps every orphan; one reaper owns ``waitpid`` and
  hands exit statuses to whoever waits on a pid.
- It is single-threaded: one epoll loop, non-blocking pipes and sockets, credit-based flow
  control per stream, so a slow reader or a 1 GiB upload never grows its memory.
"""

from __future__ import annotations

import errno
import os
import select
import stat as _stat
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from collections import deque
    from collections.abc import Callable
    from typing import Any, Dict, List, Optional, Tuple

    JsonObj = Dict[str, Any]
else:
    import _signal
    from _collections import deque

AGENT_VERSION = "1.0"
PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

MAGIC = b"\x89SANDLOT"
HEADER = struct.Struct(">IBBI")
HEADER_SIZE = 10
U32 = struct.Struct(">I")

T_HELLO = 1
T_OPEN = 2
T_DATA = 3
T_EOF = 4
T_EVENT = 5
T_END = 6
T_WINDOW = 7
T_CANCEL = 8
T_PING = 9
T_PONG = 10
T_ERROR = 11

CH_IN = 0
CH_OUT = 1
CH_ERR = 2

MAX_PAYLOAD = 16 << 20
"""Largest frame payload either side accepts; a longer frame means the framing is lost."""
MAX_DATA = 1 << 20
"""Largest DATA payload a sender produces."""
WINDOW = 4 << 20
"""Per-stream receive window this agent grants (and announces in HELLO)."""

READ_SIZE = 1 << 20
PIPE_READ = 64 << 10
FILE_CHUNK = 256 << 10
OUTQ_HIGH = 2 << 20
OUTQ_LOW = 512 << 10
OUTQ_FLUSH_NOW = 256 << 10
SOCKET_BUFFER = 2 << 20
EXIT_GRACE = 0.1
"""After a command exits, how long its pipes may stay open (held by a lingering descendant)
before the agent stops reading them."""
FOLLOW_POLL = 0.2
PTY_HANGUP_GRACE = 1.0
RING_BYTES = 8 << 20
RING_CHUNKS = 65536
KEEP_EXITED = 16
MAX_STREAMS = 4096
MARKER = "SANDLOT_EXEC_ID"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Error codes: the stable codes of sandlot.errors (plus ``cancelled``).
NOT_FOUND = "not_found"
INVALID = "invalid_request"
CONFLICT = "conflict"
BAD_STATE = "invalid_state"
TIMEOUT = "timeout"
UNSUPPORTED = "not_supported"
QUOTA = "quota_exceeded"
BACKEND = "backend_error"
CANCELLED = "cancelled"

# Signals reset to their default action in every child: Python itself ignores SIGPIPE and
# SIGXFSZ, and the agent's parent may have left others ignored.
_SIGDEF = tuple(s for s in range(1, 32) if s not in (9, 19))

_ERRNO_CODES = {
    errno.ENOENT: NOT_FOUND,
    errno.ESRCH: NOT_FOUND,
    errno.EEXIST: CONFLICT,
    errno.ENOTEMPTY: CONFLICT,
    errno.EBUSY: CONFLICT,
    errno.ETXTBSY: CONFLICT,
    errno.EACCES: INVALID,
    errno.EPERM: INVALID,
    errno.EROFS: INVALID,
    errno.EISDIR: INVALID,
    errno.ENOTDIR: INVALID,
    errno.EINVAL: INVALID,
    errno.ELOOP: INVALID,
    errno.ENAMETOOLONG: INVALID,
    errno.EXDEV: INVALID,
    errno.ENOSPC: QUOTA,
    errno.EDQUOT: QUOTA,
    errno.EFBIG: QUOTA,
}

_quiet = False


def log(msg: str) -> None:
    """One line to stderr (the sandbox's own log), unless ``--quiet``."""
    if not _quiet:
        _ignore(
            os.write, 2, ("sandlot-agent[%d]: %s\n" % (os.getpid(), msg)).encode("utf-8", "replace")
        )


def log_exc(where: str) -> None:
    import traceback

    log("%s: %s" % (where, traceback.format_exc().replace("\n", " | ")))


# --- JSON without importing json (which pulls in re and enum) -----------------------------


def _make_json() -> Tuple[Callable[[object], bytes], Callable[[Any], object]]:
    try:
        import _json

        class _Ctx:
            strict = True
            object_hook = None
            object_pairs_hook = None
            array_hook = None
            parse_float = float
            parse_int = int
            parse_constant = float

        scan = _json.make_scanner(_Ctx())  # type: ignore[arg-type]

        def _default(o: object) -> object:
            raise TypeError("not JSON serializable: %r" % type(o))

        enc = _json.make_encoder(
            None, _default, _json.encode_basestring_ascii, None, ":", ",", False, False, False
        )

        def dumps(o: object) -> bytes:
            return "".join(enc(o, 0)).encode("ascii")

        def loads(b: bytes | memoryview) -> object:
            s = bytes(b).decode("utf-8").strip(" \t\r\n")
            try:
                obj, end = scan(s, 0)
            except Exception:
                # The bare C scanner reports errors badly (even a SystemError on some
                # versions); the json module, imported only now, says what is wrong.
                import json

                return json.loads(s)
            if end != len(s):
                msg = "extra data after JSON value"
                raise ValueError(msg)
            return obj

        probe = {"a": [1, 2.5, "\u00e9\udcff", None, True, {"b": -3}]}
        if loads(dumps(probe)) != probe:
            msg = "_json round trip differs"
            raise ValueError(msg)
        return dumps, loads
    except Exception:
        import json

        def dumps2(o: object) -> bytes:
            return json.dumps(o, separators=(",", ":")).encode("ascii")

        def loads2(b: bytes | memoryview) -> object:
            return json.loads(bytes(b).decode("utf-8"))

        return dumps2, loads2


dumps, loads = _make_json()


# --- errors ---------------------------------------------------------------------------------


class AgentError(Exception):
    """An error reply with a stable code (the codes of ``sandlot.errors``)."""

    def __init__(self, code: str, message: str, **details: object) -> None:
        Exception.__init__(self, message)
        self.code = code
        self.message = message
        self.details = details


def os_error(e: OSError, what: str = "") -> AgentError:
    code = _ERRNO_CODES.get(e.errno or 0, BACKEND)
    name = errno.errorcode.get(e.errno or 0, "E?")
    target = e.filename if e.filename is not None else what
    msg = "%s: %s" % (target, e.strerror) if target else str(e.strerror or e)
    details: Dict[str, object] = {"errno": name}
    if target:
        details["path"] = target if isinstance(target, str) else os.fsdecode(target)
    return AgentError(code, msg, **details)


# --- the event loop -------------------------------------------------------------------------


class Timer:
    __slots__ = ("cancelled", "cb", "when")

    def __init__(self, when: float, cb: Callable[[], None]) -> None:
        self.when = when
        self.cb = cb
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: Timer) -> bool:
        return self.when < other.when


class Loop:
    """A minimal epoll loop: fd callbacks, timers, and work deferred to the end of an iteration."""

    def __init__(self) -> None:
        import heapq

        self._heapq = heapq
        self.ep = select.epoll()
        self.readers: Dict[int, Callable[[], None]] = {}
        self.writers: Dict[int, Callable[[], None]] = {}
        self.masks: Dict[int, int] = {}
        self.timers: List[Timer] = []
        self.soon: List[Callable[[], None]] = []
        self.flushers: List[Session] = []
        self.stopping = False

    def _update(self, fd: int) -> None:
        mask = (select.EPOLLIN if fd in self.readers else 0) | (
            select.EPOLLOUT if fd in self.writers else 0
        )
        old = self.masks.get(fd)
        try:
            if mask == 0:
                if old is not None:
                    del self.masks[fd]
                    self.ep.unregister(fd)
            elif old is None:
                self.ep.register(fd, mask)
                self.masks[fd] = mask
            elif old != mask:
                self.ep.modify(fd, mask)
                self.masks[fd] = mask
        except OSError as e:
            # A regular file cannot be polled (EPERM); a closed fd is already gone.
            if e.errno not in (errno.EBADF, errno.ENOENT, errno.EPERM):
                raise
            self.masks.pop(fd, None)

    def set_reader(self, fd: int, cb: Callable[[], None]) -> None:
        self.readers[fd] = cb
        self._update(fd)

    def del_reader(self, fd: int) -> None:
        if self.readers.pop(fd, None) is not None:
            self._update(fd)

    def set_writer(self, fd: int, cb: Callable[[], None]) -> None:
        self.writers[fd] = cb
        self._update(fd)

    def del_writer(self, fd: int) -> None:
        if self.writers.pop(fd, None) is not None:
            self._update(fd)

    def forget(self, fd: int) -> None:
        """Drop every callback of an fd that is about to be closed."""
        self.readers.pop(fd, None)
        self.writers.pop(fd, None)
        self._update(fd)

    def call_later(self, delay: float, cb: Callable[[], None]) -> Timer:
        t = Timer(time.monotonic() + delay, cb)
        self._heapq.heappush(self.timers, t)
        return t

    def call_soon(self, cb: Callable[[], None]) -> None:
        self.soon.append(cb)

    def want_flush(self, sess: Session) -> None:
        self.flushers.append(sess)

    def _run(self, cb: Callable[[], None]) -> None:
        try:
            cb()
        except Exception:
            log_exc("callback failed")

    def run(self) -> None:
        heapq = self._heapq
        while not self.stopping:
            if self.soon or self.flushers:
                timeout = 0.0
            elif self.timers:
                timeout = max(0.0, self.timers[0].when - time.monotonic())
            else:
                timeout = -1.0
            events = self.ep.poll(timeout)
            for fd, ev in events:
                if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                    cb = self.readers.get(fd)
                    if cb is not None:
                        self._run(cb)
                if ev & (select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR):
                    cb = self.writers.get(fd)
                    if cb is not None:
                        self._run(cb)
            if self.timers:
                now = time.monotonic()
                while self.timers and self.timers[0].when <= now:
                    t = heapq.heappop(self.timers)
                    if not t.cancelled:
                        self._run(t.cb)
            while self.soon:
                batch, self.soon = self.soon, []
                for cb in batch:
                    self._run(cb)
            while self.flushers:
                batch2, self.flushers = self.flushers, []
                for sess in batch2:
                    self._run(sess.flush)


# --- processes: reaping and killing whole trees ---------------------------------------------


def exit_code_of(status: int) -> Tuple[int, Optional[int]]:
    """(exit_code, signal) from a wait status; ``128 + N`` when killed by signal N."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


class Reaper:
    """The only caller of waitpid: collects every child and orphan, dispatches by pid."""

    def __init__(self) -> None:
        self.watchers: Dict[int, Callable[[int], None]] = {}

    def watch(self, pid: int, cb: Callable[[int], None]) -> None:
        self.watchers[pid] = cb

    def unwatch(self, pid: int) -> None:
        self.watchers.pop(pid, None)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            cb = self.watchers.pop(pid, None)
            if cb is not None:
                try:
                    cb(status)
                except Exception:
                    log_exc("exit handler failed")


def _proc_stat(pid: int) -> Optional[Tuple[bytes, int, int, int]]:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses; fields resume after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def tree_members(
    roots: List[int], needle: Optional[bytes], parents: Tuple[int, ...] = ()
) -> List[int]:
    """Live processes that belong to the trees rooted at ``roots``.

    A process belongs when its session or process group is one of the roots (each command is
    started with setsid, so its pid is both), when it descends from a root or from another
    member, or when its initial environment carries ``needle`` (the per-command marker, which
    survives setsid and double forks). Descendants of ``parents`` belong too (but not the
    parents themselves). Zombies are skipped: they are already dead.
    """
    me = os.getpid()
    stats: Dict[int, Tuple[bytes, int, int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        names = []
    for name in names:
        if name.isdigit():
            pid = int(name)
            if pid != me and pid != 1:
                st = _proc_stat(pid)
                if st is not None and st[0] != b"Z":
                    stats[pid] = st
    rootset = set(roots)
    members = set()
    children: Dict[int, List[int]] = {}
    for pid, (_, ppid, pgrp, sid) in stats.items():
        children.setdefault(ppid, []).append(pid)
        if pid in rootset or sid in rootset or pgrp in rootset:
            members.add(pid)
    if needle is not None:
        for pid in stats:
            if pid not in members:
                try:
                    with open("/proc/%d/environ" % pid, "rb") as f:
                        env = b"\0" + f.read()
                except OSError:
                    continue
                if needle in env:
                    members.add(pid)
    stack = list(members) + [r for r in roots if r not in members] + list(parents)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in members:
                members.add(child)
                stack.append(child)
    return sorted(members)


def _kill(pid: int, sig: int) -> None:
    _ignore(os.kill, pid, sig)


def _ignore(fn: Callable[..., object], *args: object) -> None:
    """Call ``fn`` and ignore OSError (contextlib costs startup time)."""
    try:
        fn(*args)
    except OSError:
        return


def kill_tree(
    roots: List[int], needle: Optional[bytes], sig: int = 9, parents: Tuple[int, ...] = ()
) -> int:
    """Send ``sig`` to every member of the trees; for SIGKILL, freeze them first.

    Freezing (SIGSTOP) each newly found member and rescanning until nothing new appears means a
    process cannot fork a new member between the scan that found it and the kill.
    """
    if sig != 9:
        found = tree_members(roots, needle, parents)
        for pid in found:
            _kill(pid, sig)
        return len(found)
    killed = 0
    # A member whose SIGSTOP was still pending can fork once more after the last scan (seen
    # under gVisor, where signals arrive later): so the whole round repeats until a scan finds
    # no member left.
    for _ in range(20):
        stopped: List[int] = []
        seen = set()
        for _ in range(100):
            new = [p for p in tree_members(roots, needle, parents) if p not in seen]
            if not new:
                break
            for pid in new:
                _kill(pid, 19)
                seen.add(pid)
                stopped.append(pid)
        for pid in stopped:
            _kill(pid, 9)
        for root in roots:
            _ignore(os.killpg, root, 9)
        if not stopped:
            break
        killed += len(stopped)
    return killed


# --- sessions: framing, flow control, dispatch ----------------------------------------------


class Stream:
    """One request on a session: sends DATA within the peer's credit, acks what it consumes."""

    def __init__(self, sess: Session, sid: int) -> None:
        self.sess = sess
        self.sid = sid
        self.credit = sess.peer_window
        self.unacked = 0
        self.inflight = 0
        self.done = False
        sess.streams[sid] = self

    # inbound, called by the session
    def on_data(self, chan: int, data: memoryview) -> None:
        self.ack(len(data))
        self.fail(INVALID, "this request takes no input")

    def on_eof(self, chan: int) -> None:
        pass

    def on_event(self, obj: JsonObj) -> None:
        pass

    def on_credit(self) -> None:
        pass

    def resume(self) -> None:
        self.on_credit()

    def on_cancel(self) -> None:
        self.abort()
        self.fail(CANCELLED, "cancelled by the client")

    def abort(self) -> None:
        """Release everything (kill processes, remove temp files); no reply is sent."""

    # outbound helpers
    def can_send(self, n: int) -> bool:
        if self.sess.outq_bytes >= OUTQ_HIGH:
            self.sess.blocked.add(self)
            return False
        return self.credit >= n

    def data(self, chan: int, payload: bytes) -> None:
        self.credit -= len(payload)
        self.sess.send(T_DATA, self.sid, payload, chan)

    def event(self, obj: JsonObj) -> None:
        self.sess.send(T_EVENT, self.sid, dumps(obj))

    def ack(self, n: int) -> None:
        self.unacked += n
        if self.unacked >= WINDOW // 4:
            self.sess.send(T_WINDOW, self.sid, U32.pack(self.unacked))
            self.inflight -= self.unacked
            self.unacked = 0

    def _close(self) -> bool:
        if self.done:
            return False
        self.done = True
        if self.sess.streams.get(self.sid) is self:
            del self.sess.streams[self.sid]
        self.sess.blocked.discard(self)
        return True

    def finish(self, result: JsonObj) -> None:
        if self._close() and not self.sess.closed:
            self.sess.send(T_END, self.sid, dumps({"ok": True, "result": result}))

    def fail(self, code: str, message: str, **details: object) -> None:
        if self._close() and not self.sess.closed:
            self.sess.send_error_end(self.sid, code, message, details)


class Session:
    """One protocol session over a byte stream (a socket connection or a device).

    A session on a device (``keep_fds``) leaves the device open when it ends, unless reading
    or writing it failed: the next session continues on it. Such a session also ends when a
    new host's MAGIC arrives where a frame should start (a device cannot tell two host
    connections apart), handing those bytes to the next session in ``leftover``.
    """

    def __init__(
        self,
        agent: Agent,
        rfd: int,
        wfd: int,
        on_close: Optional[Callable[[Session], None]] = None,
        keep_fds: bool = False,
    ) -> None:
        self.agent = agent
        self.loop = agent.loop
        self.rfd = rfd
        self.wfd = wfd
        self.on_close = on_close
        self.keep_fds = keep_fds
        self.leftover = b""
        self.detach_when_flushed = False
        self.pend: List[bytes] = []
        self.pend_len = 0
        self.need = len(MAGIC)
        self.synced = False
        self.ready = False
        self.outq: deque[Any] = deque()
        self.outq_bytes = 0
        self.writing = False
        self.flush_pending = False
        self.streams: Dict[int, Stream] = {}
        self.blocked: set[Stream] = set()
        self.last_sid = 0
        self.peer_window = WINDOW
        self.closed = False
        os.set_blocking(rfd, False)
        if wfd != rfd:
            os.set_blocking(wfd, False)
        self.loop.set_reader(rfd, self.on_readable)

    # reading
    def on_readable(self) -> None:
        try:
            data = os.read(self.rfd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError as e:
            self.keep_fds = False
            self.close("read failed: %s" % e)
            return
        if not data:
            self.close("end of stream")
            return
        self.pend.append(data)
        self.pend_len += len(data)
        if self.pend_len >= self.need:
            buf = self.pend[0] if len(self.pend) == 1 else b"".join(self.pend)
            self.pend = []
            self.pend_len = 0
            self.parse(buf)

    def parse(self, buf: bytes) -> None:
        off = 0
        n = len(buf)
        if not self.synced:
            i = buf.find(MAGIC)
            if i < 0:
                # Keep a tail that may be the start of the magic; drop the rest (stale bytes).
                keep = buf[-(len(MAGIC) - 1) :]
                self.pend = [keep]
                self.pend_len = len(keep)
                return
            self.synced = True
            off = i + len(MAGIC)
            self.need = HEADER_SIZE
            # Our own magic precedes our first frame, so the host can skip stale bytes too.
            self.outq.append(MAGIC)
            self.outq_bytes += len(MAGIC)
        mv = memoryview(buf)
        while not self.closed:
            if n - off < HEADER_SIZE:
                self.need = HEADER_SIZE
                break
            length, ftype, chan, sid = HEADER.unpack_from(buf, off)
            if length > MAX_PAYLOAD and self.keep_fds and buf.startswith(MAGIC, off):
                # A new host on the device while this session still waited for its old host's
                # next frame (it had not read the hang-up yet): the new one starts afresh.
                self.leftover = buf[off:]
                self.close("a new host")
                return
            if length > MAX_PAYLOAD:
                self.protocol_error(
                    "frame of %d bytes exceeds the %d-byte limit" % (length, MAX_PAYLOAD)
                )
                return
            end = off + HEADER_SIZE + length
            if end > n:
                self.need = HEADER_SIZE + length
                break
            payload = mv[off + HEADER_SIZE : end]
            off = end
            try:
                self.on_frame(ftype, chan, sid, payload)
            except Exception:
                log_exc("frame handling failed")
        if off < n and not self.closed:
            rest = buf[off:]
            self.pend = [rest]
            self.pend_len = len(rest)

    def on_frame(self, ftype: int, chan: int, sid: int, payload: memoryview) -> None:
        if not self.ready:
            if ftype == T_HELLO:
                self.on_hello(payload)
            elif ftype == T_PING:
                self.send(T_PONG, 0, bytes(payload[:64]))
            else:
                self.protocol_error("expected HELLO, got frame type %d" % ftype)
            return
        if ftype == T_DATA:
            st = self.streams.get(sid)
            if st is not None:
                st.inflight += len(payload)
                if st.inflight > WINDOW:
                    st.abort()
                    st.fail(INVALID, "flow-control window exceeded")
                else:
                    st.on_data(chan, payload)
        elif ftype == T_OPEN:
            self.on_open(sid, payload)
        elif ftype == T_WINDOW:
            st = self.streams.get(sid)
            if st is not None and len(payload) == 4:
                st.credit += U32.unpack(payload)[0]
                st.on_credit()
        elif ftype == T_EOF:
            st = self.streams.get(sid)
            if st is not None:
                st.on_eof(chan)
        elif ftype == T_EVENT:
            st = self.streams.get(sid)
            if st is not None:
                try:
                    obj = loads(payload)
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    st.on_event(obj)
                else:
                    self.send_error(sid, INVALID, "EVENT payload is not a JSON object")
        elif ftype == T_CANCEL:
            st = self.streams.get(sid)
            if st is not None:
                st.on_cancel()
        elif ftype == T_PING:
            self.send(T_PONG, 0, bytes(payload[:64]))
        elif ftype in (T_PONG, T_ERROR, T_END, T_HELLO):
            pass
        else:
            self.send_error(sid, INVALID, "unknown frame type %d" % ftype)

    def on_hello(self, payload: memoryview) -> None:
        try:
            hello = loads(payload)
        except ValueError:
            hello = None
        if not isinstance(hello, dict):
            self.protocol_error("HELLO payload is not a JSON object")
            return
        versions = hello.get("versions")
        common = [v for v in SUPPORTED_VERSIONS if isinstance(versions, list) and v in versions]
        if not common:
            self.send_error(
                0,
                UNSUPPORTED,
                "no common protocol version: agent speaks %s, client %r"
                % (list(SUPPORTED_VERSIONS), versions),
            )
            self.close("version mismatch", flush=True)
            return
        window = hello.get("window")
        if isinstance(window, int) and 64 << 10 <= window <= 1 << 30:
            self.peer_window = window
        self.ready = True
        reply = self.agent.hello(max(common))
        nonce = hello.get("nonce")
        if isinstance(nonce, str) and len(nonce) <= 64:
            # Echoed, so a host that retried its handshake on a device (where an earlier
            # attempt's HELLO may be answered late) knows which answer is its own.
            reply["nonce"] = nonce
        self.send(T_HELLO, 0, dumps(reply))

    def on_open(self, sid: int, payload: memoryview) -> None:
        if sid == 0 or sid <= self.last_sid:
            self.send_error_end(
                sid, "invalid_request", "stream id %d is not above %d" % (sid, self.last_sid), {}
            )
            return
        self.last_sid = sid
        try:
            req = loads(payload)
        except ValueError as e:
            self.send_error_end(sid, INVALID, "malformed request: %s" % e, {})
            return
        if not isinstance(req, dict) or not isinstance(req.get("op"), str):
            self.send_error_end(sid, INVALID, 'a request is a JSON object with "op"', {})
            return
        op = req["op"]
        handler = OPS.get(op)
        if handler is None:
            self.send_error_end(sid, UNSUPPORTED, "unknown op %r" % op, {"op": op})
            return
        if len(self.streams) >= MAX_STREAMS:
            self.send_error_end(sid, QUOTA, "too many open streams", {})
            return
        try:
            result = handler(self, sid, req)
        except Exception as e:
            st = self.streams.pop(sid, None)
            if st is not None:
                st.done = True
                st.abort()
            err = _as_agent_error(e, op)
            self.send_error_end(sid, err.code, err.message, err.details)
            return
        if result is not None:
            self.send(T_END, sid, dumps({"ok": True, "result": result}))

    # writing
    def send(self, ftype: int, sid: int, payload: bytes = b"", chan: int = 0) -> None:
        if self.closed:
            return
        hdr = HEADER.pack(len(payload), ftype, chan, sid)
        if len(payload) < 4096:
            self.outq.append(hdr + payload)
        else:
            self.outq.append(hdr)
            self.outq.append(payload)
        self.outq_bytes += HEADER_SIZE + len(payload)
        if self.writing:
            return
        if self.outq_bytes >= OUTQ_FLUSH_NOW:
            self.flush()
        elif not self.flush_pending:
            # Frames produced in one loop iteration go out in one writev.
            self.flush_pending = True
            self.loop.want_flush(self)

    def send_error_end(self, sid: int, code: str, message: str, details: Dict[str, object]) -> None:
        err = {"code": code, "message": message, "details": details}
        self.send(T_END, sid, dumps({"ok": False, "error": err}))

    def send_error(self, sid: int, code: str, message: str) -> None:
        self.send(T_ERROR, sid, dumps({"code": code, "message": message}))

    def flush(self) -> None:
        self.flush_pending = False
        if self.closed:
            return
        q = self.outq
        while q:
            bufs = [q[i] for i in range(min(len(q), 256))]
            try:
                n = os.writev(self.wfd, bufs)
            except BlockingIOError:
                n = -1
            except OSError as e:
                self.keep_fds = False
                self.close("write failed: %s" % e)
                return
            if n < 0:
                if not self.writing:
                    self.writing = True
                    self.loop.set_writer(self.wfd, self.flush)
                return
            self.outq_bytes -= n
            while n:
                head = q[0]
                if len(head) <= n:
                    n -= len(head)
                    q.popleft()
                else:
                    q[0] = memoryview(head)[n:]
                    n = 0
        if self.writing:
            self.writing = False
            self.loop.del_writer(self.wfd)
        if self.detach_when_flushed:
            self.close("detached")
            return
        if self.blocked and self.outq_bytes < OUTQ_LOW:
            blocked, self.blocked = self.blocked, set()
            for st in blocked:
                if not st.done:
                    self.loop.call_soon(st.resume)

    def protocol_error(self, message: str) -> None:
        log("protocol error: %s" % message)
        self.send_error(0, INVALID, message)
        self.close("protocol error", flush=True)

    def close(self, reason: str, flush: bool = False) -> None:
        if self.closed:
            return
        if flush and self.outq:
            # Best effort only: a peer that does not read must not hang the agent.
            _ignore(os.writev, self.wfd, [self.outq[i] for i in range(min(len(self.outq), 64))])
        self.closed = True
        self.loop.forget(self.rfd)
        self.loop.forget(self.wfd)
        streams = list(self.streams.values())
        self.streams.clear()
        for st in streams:
            st.done = True
            try:
                st.abort()
            except Exception:
                log_exc("abort failed")
        self.outq.clear()
        self.outq_bytes = 0
        if not self.keep_fds:
            for fd in {self.rfd, self.wfd}:
                _ignore(os.close, fd)
        if self.on_close is not None:
            self.on_close(self)


def _as_agent_error(e: Exception, op: str) -> AgentError:
    if isinstance(e, AgentError):
        return e
    if isinstance(e, OSError):
        return os_error(e)
    if isinstance(e, (ValueError, TypeError, KeyError)):
        return AgentError(INVALID, "%s: %s" % (op, e))
    log_exc("op %s failed" % op)
    return AgentError(BACKEND, "%s failed inside the agent: %r" % (op, e))


# --- request field helpers ------------------------------------------------------------------


def _bad(msg: str) -> AgentError:
    return AgentError(INVALID, msg)


def req_str(req: JsonObj, key: str, default: Optional[str] = None) -> Optional[str]:
    v = req.get(key, default)
    if v is not None and not isinstance(v, str):
        msg = "%r must be a string" % key
        raise _bad(msg)
    return v


def req_path(req: JsonObj, key: str = "path") -> str:
    v = req.get(key)
    if not isinstance(v, str) or not v.startswith("/"):
        msg = "%r must be an absolute path" % key
        raise _bad(msg)
    if "\0" in v:
        msg = "%r contains a NUL byte" % key
        raise _bad(msg)
    return v


def req_int(req: JsonObj, key: str, default: Optional[int] = None) -> Optional[int]:
    v = req.get(key, default)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        msg = "%r must be an integer" % key
        raise _bad(msg)
    return v


def req_num(req: JsonObj, key: str) -> Optional[float]:
    v = req.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        msg = "%r must be a non-negative number" % key
        raise _bad(msg)
    return float(v)


def req_argv(req: JsonObj) -> List[str]:
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        msg = '"argv" must be a non-empty list of strings'
        raise _bad(msg)
    if any("\0" in a for a in argv):
        msg = '"argv" contains a NUL byte'
        raise _bad(msg)
    return argv


def req_env(req: JsonObj) -> Dict[str, str]:
    env = req.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        msg = '"env" must be an object of strings'
        raise _bad(msg)
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            msg = "invalid environment variable %r" % k
            raise _bad(msg)
    return env


# --- commands -------------------------------------------------------------------------------


class Child:
    """A spawned command's pipes and tree identity, shared by exec, background and PTY."""

    def __init__(self, pid: int, token: str) -> None:
        self.pid = pid
        self.token = token
        self.started = time.monotonic()
        self.started_wall = time.time()

    def needle(self) -> bytes:
        return ("\0%s=%s\0" % (MARKER, self.token)).encode()

    def kill(self, sig: int = 9) -> int:
        return kill_tree([self.pid], self.needle(), sig)


class SpawnFailed(Exception):
    def __init__(self, code: int, message: str) -> None:
        Exception.__init__(self, message)
        self.code = code
        self.message = message


class Exec(Stream):
    """``exec``: run to completion, stream stdout/stderr, optional stdin and timeout."""

    def __init__(self, sess: Session, sid: int, req: JsonObj) -> None:
        agent = sess.agent
        argv = req_argv(req)
        env = req_env(req)
        cwd = req_str(req, "cwd")
        timeout = req_num(req, "timeout")
        want_stdin = bool(req.get("stdin"))
        self.loop = sess.loop
        self.agent = agent
        self.fds: Dict[int, int] = {}
        self.in_fd = -1
        self.inq: deque[memoryview] = deque()
        self.in_eof = False
        self.status: Optional[int] = None
        self.timed_out = False
        self.draining = False
        self.paused = False
        self.timer: Optional[Timer] = None
        self.grace: Optional[Timer] = None
        self.oom_before = agent.oom_count()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if want_stdin else (-1, -1)
        try:
            self.child: Optional[Child] = agent.spawn(
                argv, cwd, env, (in_r if want_stdin else agent.devnull, out_w, err_w)
            )
        except SpawnFailed as e:
            self.child = None
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            Stream.__init__(self, sess, sid)
            self.data(CH_ERR, ("sandlot-agent: %s\n" % e.message).encode("utf-8", "replace"))
            self.finish(
                {
                    "exit_code": e.code,
                    "signal": None,
                    "timed_out": False,
                    "duration_ms": 0.0,
                    "pid": 0,
                }
            )
            return
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, in_r):
                if fd >= 0:
                    os.close(fd)
        Stream.__init__(self, sess, sid)
        agent.reaper.watch(self.child.pid, self.on_exit)
        for fd, chan in ((out_r, CH_OUT), (err_r, CH_ERR)):
            os.set_blocking(fd, False)
            self.fds[fd] = chan
            self.loop.set_reader(fd, self._reader(fd))
        if want_stdin:
            os.set_blocking(in_w, False)
            self.in_fd = in_w
        if timeout is not None:
            self.timer = self.loop.call_later(timeout, self.on_timeout)

    def _reader(self, fd: int) -> Callable[[], None]:
        return lambda: self.on_readable(fd)

    def on_readable(self, fd: int) -> None:
        chan = self.fds.get(fd)
        if chan is None or self.done:
            return
        n = min(PIPE_READ, self.credit)
        if n <= 0 or self.sess.outq_bytes >= OUTQ_HIGH:
            self.can_send(1)
            self.pause()
            return
        try:
            data = os.read(fd, n)
        except BlockingIOError:
            if self.draining:
                self.close_fd(fd)
            return
        except OSError:
            data = b""
        if data:
            self.data(chan, data)
        else:
            self.close_fd(fd)

    def pause(self) -> None:
        if not self.paused:
            self.paused = True
            for fd in self.fds:
                self.loop.del_reader(fd)

    def on_credit(self) -> None:
        if self.paused and not self.done and self.credit > 0:
            self.paused = False
            for fd in list(self.fds):
                self.loop.set_reader(fd, self._reader(fd))
            if self.draining:
                for fd in list(self.fds):
                    self.on_readable(fd)

    def close_fd(self, fd: int) -> None:
        if self.fds.pop(fd, None) is not None:
            self.loop.forget(fd)
            os.close(fd)
        self.maybe_complete()

    def on_exit(self, status: int) -> None:
        self.status = status
        self.ended = time.monotonic()
        if self.done:
            return
        if self.fds:
            self.grace = self.loop.call_later(EXIT_GRACE, self.on_grace)
        self.maybe_complete()

    def on_grace(self) -> None:
        # A descendant still holds the pipes: take what is buffered now, then stop reading.
        self.draining = True
        if not self.paused:
            for fd in list(self.fds):
                self.on_readable(fd)

    def on_timeout(self) -> None:
        self.timer = None
        if self.status is None and self.child is not None and not self.done:
            self.timed_out = True
            self.child.kill(9)

    def maybe_complete(self) -> None:
        if self.done or self.status is None or self.fds or self.child is None:
            return
        code, sig = exit_code_of(self.status)
        oom = sig == 9 and not self.timed_out and self.agent.oom_count() > self.oom_before
        if self.timed_out:
            code = 124
        self.release()
        self.finish(
            {
                "exit_code": code,
                "signal": sig,
                "timed_out": self.timed_out,
                "oom_killed": oom,
                "duration_ms": round((self.ended - self.child.started) * 1000.0, 3),
                "pid": self.child.pid,
            }
        )

    def release(self) -> None:
        for t in (self.timer, self.grace):
            if t is not None:
                t.cancel()
        for fd in list(self.fds):
            self.loop.forget(fd)
            os.close(fd)
        self.fds.clear()
        self.close_stdin()

    def close_stdin(self) -> None:
        if self.in_fd >= 0:
            self.loop.forget(self.in_fd)
            os.close(self.in_fd)
            self.in_fd = -1
        while self.inq:
            self.ack(len(self.inq.popleft()))

    def abort(self) -> None:
        if self.child is not None and self.status is None:
            self.agent.reaper.unwatch(self.child.pid)
            self.child.kill(9)
        self.release()

    # stdin
    def on_data(self, chan: int, data: memoryview) -> None:
        if self.in_fd < 0 or chan != CH_IN:
            self.ack(len(data))
            return
        self.inq.append(memoryview(bytes(data)))
        self.write_stdin()

    def on_eof(self, chan: int) -> None:
        self.in_eof = True
        self.write_stdin()

    def write_stdin(self) -> None:
        while self.inq and self.in_fd >= 0:
            buf = self.inq[0]
            try:
                n = os.write(self.in_fd, buf)
            except BlockingIOError:
                self.loop.set_writer(self.in_fd, self.write_stdin)
                return
            except OSError:
                # The command closed its stdin; what is left can never be delivered.
                self.close_stdin()
                return
            self.ack(n)
            if n == len(buf):
                self.inq.popleft()
            else:
                self.inq[0] = buf[n:]
        if self.in_fd >= 0:
            self.loop.del_writer(self.in_fd)
            if self.in_eof:
                self.close_stdin()


class BgProcess:
    """A background process: output kept in a bounded ring (and appended to a log file)."""

    def __init__(self, agent: Agent, pid_id: str, req: JsonObj) -> None:
        argv = req_argv(req)
        env = req_env(req)
        cwd = req_str(req, "cwd")
        self.name = req_str(req, "name")
        log_path = req.get("log_path")
        self.agent = agent
        self.loop = agent.loop
        self.id = pid_id
        self.argv = argv
        self.exit_code: Optional[int] = None
        self.signal: Optional[int] = None
        self.status: Optional[int] = None
        self.finalized = False
        self.chunks: List[Tuple[int, bytes]] = []
        self.base = 0
        self.first_seq = 0
        self.next_seq = 0
        self.ring_bytes = 0
        self.subs: set[ProcOutput] = set()
        self.waiters: set[ProcWait] = set()
        self.stdin_q: deque[Tuple[ProcStdin, memoryview]] = deque()
        self.fds: Dict[int, int] = {}
        self.log_fd = -1
        self.grace: Optional[Timer] = None
        if log_path is not None:
            lp = req_path(req, "log_path")
            parent = os.path.dirname(lp)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self.log_fd = os.open(lp, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe()
        try:
            self.child = agent.spawn(argv, cwd, env, (in_r, out_w, err_w))
        except SpawnFailed as e:
            for fd in (out_r, err_r, in_w, self.log_fd):
                if fd >= 0:
                    os.close(fd)
            raise AgentError(NOT_FOUND if e.code == 127 else INVALID, e.message) from None
        except BaseException:
            for fd in (out_r, err_r, in_w, self.log_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, in_r):
                os.close(fd)
        self.in_fd = in_w
        os.set_blocking(in_w, False)
        agent.reaper.watch(self.child.pid, self.on_exit)
        for fd, chan in ((out_r, CH_OUT), (err_r, CH_ERR)):
            os.set_blocking(fd, False)
            self.fds[fd] = chan
            self.loop.set_reader(fd, self._reader(fd))

    def _reader(self, fd: int) -> Callable[[], None]:
        return lambda: self.on_readable(fd)

    def info(self) -> JsonObj:
        return {
            "id": self.id,
            "pid": self.child.pid,
            "command": self.argv,
            "name": self.name,
            "running": not self.finalized,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "started_at": self.child.started_wall,
            "first_seq": self.first_seq,
            "next_seq": self.next_seq,
        }

    def on_readable(self, fd: int) -> None:
        chan = self.fds.get(fd)
        if chan is None:
            return
        try:
            data = os.read(fd, PIPE_READ)
        except BlockingIOError:
            if self.status is not None and self.grace is None:
                self.close_fd(fd)
            return
        except OSError:
            data = b""
        if not data:
            self.close_fd(fd)
            return
        self.append(chan, data)

    def append(self, chan: int, data: bytes) -> None:
        if self.log_fd >= 0:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.log_fd, view) :]
            except OSError as e:
                log("process %s: appending to its log failed (%s); log disabled" % (self.id, e))
                os.close(self.log_fd)
                self.log_fd = -1
        self.chunks.append((chan, data))
        self.next_seq += 1
        self.ring_bytes += len(data)
        while self.ring_bytes > RING_BYTES or len(self.chunks) - self.base > RING_CHUNKS:
            self.ring_bytes -= len(self.chunks[self.base][1])
            self.base += 1
            self.first_seq += 1
        if self.base > 1024 and self.base * 2 > len(self.chunks):
            del self.chunks[: self.base]
            self.base = 0
        for sub in list(self.subs):
            sub.pump()

    def chunk(self, seq: int) -> Tuple[int, bytes]:
        return self.chunks[self.base + seq - self.first_seq]

    def close_fd(self, fd: int) -> None:
        if self.fds.pop(fd, None) is not None:
            self.loop.forget(fd)
            os.close(fd)
        self.maybe_finalize()

    def on_exit(self, status: int) -> None:
        self.status = status
        if self.fds:
            self.grace = self.loop.call_later(EXIT_GRACE, self.on_grace)
        self.maybe_finalize()

    def on_grace(self) -> None:
        self.grace = None
        for fd in list(self.fds):
            for _ in range(64):
                if fd not in self.fds:
                    break
                self.on_readable(fd)
            if fd in self.fds:
                self.close_fd(fd)

    def maybe_finalize(self) -> None:
        if self.finalized or self.status is None or self.fds:
            return
        self.finalized = True
        if self.grace is not None:
            self.grace.cancel()
        self.exit_code, self.signal = exit_code_of(self.status)
        if self.log_fd >= 0:
            os.close(self.log_fd)
            self.log_fd = -1
        self.close_stdin("the process has exited")
        for sub in list(self.subs):
            sub.pump()
        for w in list(self.waiters):
            w.finish(self.info())
        self.waiters.clear()
        self.agent.retire()

    # stdin
    def close_stdin(self, why: Optional[str] = None) -> None:
        if self.in_fd >= 0:
            self.loop.forget(self.in_fd)
            os.close(self.in_fd)
            self.in_fd = -1
        while self.stdin_q:
            st, buf = self.stdin_q.popleft()
            st.ack(len(buf))
            if why is not None:
                st.fail(BAD_STATE, "stdin is closed: %s" % why)
        # A writer whose bytes were all written is not failed: the program read them and then
        # exited before the writer's end of input arrived (``read x; exit``), which is the
        # normal course; it finishes when that end arrives (maybe_done).

    def write_stdin(self) -> None:
        while self.stdin_q and self.in_fd >= 0:
            st, buf = self.stdin_q[0]
            try:
                n = os.write(self.in_fd, buf)
            except BlockingIOError:
                self.loop.set_writer(self.in_fd, self.write_stdin)
                return
            except OSError:
                self.close_stdin("the process closed it")
                return
            st.ack(n)
            if n == len(buf):
                self.stdin_q.popleft()
                st.pending -= 1
                st.maybe_done()
            else:
                self.stdin_q[0] = (st, buf[n:])
        if self.in_fd >= 0:
            self.loop.del_writer(self.in_fd)


class ProcOutput(Stream):
    """``proc.output``: a reader's cursor into a background process's ring."""

    def __init__(self, sess: Session, sid: int, proc: BgProcess, offset: int, follow: bool) -> None:
        Stream.__init__(self, sess, sid)
        self.proc = proc
        self.follow = follow
        self.cursor = min(max(offset, proc.first_seq), proc.next_seq)
        # A one-shot read is of the output there is now: were it to chase the end, a process
        # printing faster than the reader reads would keep it going for ever.
        self.end = proc.next_seq
        self.event({"type": "seq", "seq": self.cursor})
        proc.subs.add(self)
        self.pump()

    def pump(self) -> None:
        if self.done:
            return
        proc = self.proc
        sent = 0
        while self.cursor < (proc.next_seq if self.follow else self.end):
            # Output we had not sent yet may have fallen out of the ring while this reader
            # waited. The jump is told only with the chunk it lands on: a reader out of credit
            # gets nothing, not an event for every chunk the process prints meanwhile (which
            # made readers that never read cost the host as much as those that did).
            cursor = max(self.cursor, proc.first_seq)
            if not self.follow and cursor >= self.end:
                self.cursor = cursor  # all it was to read fell out of the ring meanwhile
                break
            chan, data = proc.chunk(cursor)
            if not self.can_send(len(data)):
                return
            if cursor != self.cursor:
                self.cursor = cursor
                self.event({"type": "seq", "seq": cursor})
            self.data(chan, data)
            self.cursor += 1
            sent += 1
            if sent >= 64:
                self.sess.loop.call_soon(self.pump)
                return
        if proc.finalized or not self.follow:
            proc.subs.discard(self)
            self.finish({"next_seq": self.cursor, "process": proc.info()})

    def on_credit(self) -> None:
        self.pump()

    def abort(self) -> None:
        self.proc.subs.discard(self)


class ProcWait(Stream):
    def __init__(self, sess: Session, sid: int, proc: BgProcess, timeout: Optional[float]) -> None:
        Stream.__init__(self, sess, sid)
        self.proc = proc
        self.timer: Optional[Timer] = None
        proc.waiters.add(self)
        if timeout is not None:
            self.timer = sess.loop.call_later(timeout, self.on_timeout)

    def on_timeout(self) -> None:
        self.proc.waiters.discard(self)
        self.fail(TIMEOUT, "process %s still running" % self.proc.id)

    def finish(self, result: JsonObj) -> None:
        if self.timer is not None:
            self.timer.cancel()
        Stream.finish(self, result)

    def abort(self) -> None:
        self.proc.waiters.discard(self)
        if self.timer is not None:
            self.timer.cancel()


class ProcStdin(Stream):
    def __init__(self, sess: Session, sid: int, proc: BgProcess, close: bool) -> None:
        Stream.__init__(self, sess, sid)
        self.proc = proc
        self.close_after = close
        self.eof = False
        self.pending = 0
        sess.agent.stdin_streams.add(self)

    def on_data(self, chan: int, data: memoryview) -> None:
        if self.proc.in_fd < 0:
            self.ack(len(data))
            self.fail(BAD_STATE, "stdin of %s is closed" % self.proc.id)
            return
        self.pending += 1
        self.proc.stdin_q.append((self, memoryview(bytes(data))))
        self.proc.write_stdin()

    def on_eof(self, chan: int) -> None:
        self.eof = True
        self.maybe_done()

    def maybe_done(self) -> None:
        # Every byte it sent was written (pending 0): done, even if the program has closed
        # its input or exited since; undelivered bytes were failed in close_stdin.
        if self.eof and self.pending == 0 and not self.done:
            if self.close_after and self.proc.in_fd >= 0:
                self.proc.close_stdin()
            self.finish({})

    def _close(self) -> bool:
        self.sess.agent.stdin_streams.discard(self)
        return Stream._close(self)

    def abort(self) -> None:
        self.sess.agent.stdin_streams.discard(self)
        kept = deque(item for item in self.proc.stdin_q if item[0] is not self)
        self.proc.stdin_q.clear()
        self.proc.stdin_q.extend(kept)


class Pty(Stream):
    """``pty.open``: a program on a new terminal; input on chan 0, output on chan 1."""

    def __init__(self, sess: Session, sid: int, req: JsonObj) -> None:
        import fcntl
        import termios

        self.fcntl = fcntl
        self.termios = termios
        agent = sess.agent
        argv = req_argv(req)
        env = req_env(req)
        cwd = req_str(req, "cwd")
        rows = req_int(req, "rows", 24) or 24
        cols = req_int(req, "cols", 80) or 80
        if "TERM" not in env and "TERM" not in agent.default_env:
            env = dict(env)
            env["TERM"] = "xterm-256color"
        master, slave = os.openpty()
        try:
            os.set_inheritable(master, False)
            self._winsize(master, rows, cols)
            path = os.ttyname(slave)
            try:
                self.child = agent.spawn(argv, cwd, env, None, tty=path)
            except SpawnFailed as e:
                raise AgentError(
                    NOT_FOUND if e.code == 127 else "invalid_request", e.message
                ) from None
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        Stream.__init__(self, sess, sid)
        self.loop = sess.loop
        self.agent = agent
        self.master = master
        self.status: Optional[int] = None
        self.eof = False
        self.paused = False
        self.draining = False
        self.outq: deque[memoryview] = deque()
        self.id = "t-%s-%d" % (agent.boot, sid)
        os.set_blocking(master, False)
        agent.reaper.watch(self.child.pid, self.on_exit)
        self.loop.set_reader(master, self.on_readable)
        self.event({"type": "started", "id": self.id, "pid": self.child.pid})

    def _winsize(self, fd: int, rows: int, cols: int) -> None:
        if not (0 < rows < 65536 and 0 < cols < 65536):
            msg = "rows and cols must be within 1..65535"
            raise _bad(msg)
        self.fcntl.ioctl(fd, self.termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def on_readable(self) -> None:
        if self.done or self.master < 0:
            return
        n = min(PIPE_READ, self.credit)
        if n <= 0 or self.sess.outq_bytes >= OUTQ_HIGH:
            self.can_send(1)
            self.paused = True
            self.loop.del_reader(self.master)
            return
        try:
            data = os.read(self.master, n)
        except BlockingIOError:
            if not self.draining:
                return
            data = b""
        except OSError:
            # EIO: every slave fd is closed (the program and its children are gone).
            data = b""
        if data:
            self.data(CH_OUT, data)
            return
        self.eof = True
        self.loop.del_reader(self.master)
        self.maybe_complete()

    def on_credit(self) -> None:
        if self.paused and not self.done and self.master >= 0 and not self.eof:
            self.paused = False
            self.loop.set_reader(self.master, self.on_readable)
            if self.draining:
                self.on_readable()

    def on_exit(self, status: int) -> None:
        self.status = status
        if not self.eof:
            self.loop.call_later(EXIT_GRACE, self.on_grace)
        self.maybe_complete()

    def on_grace(self) -> None:
        # Something else still holds the terminal: deliver what is buffered, then stop.
        self.draining = True
        if not self.eof and not self.done and not self.paused:
            self.on_readable()

    def maybe_complete(self) -> None:
        if self.done or self.status is None or not self.eof:
            return
        code, sig = exit_code_of(self.status)
        self.release()
        self.finish({"exit_code": code, "signal": sig, "id": self.id})

    def release(self) -> None:
        if self.master >= 0:
            self.loop.forget(self.master)
            os.close(self.master)
            self.master = -1
        while self.outq:
            self.ack(len(self.outq.popleft()))

    def abort(self) -> None:
        child = self.child
        if self.status is None:
            # Hang up like a terminal does, then make sure nothing is left behind.
            _ignore(os.killpg, child.pid, 1)
            self.release()

            def finish_off() -> None:
                if self.status is None:
                    child.kill(9)

            self.loop.call_later(PTY_HANGUP_GRACE, finish_off)
        else:
            self.release()

    def on_data(self, chan: int, data: memoryview) -> None:
        if self.master < 0 or chan != CH_IN:
            self.ack(len(data))
            return
        self.outq.append(memoryview(bytes(data)))
        self.write_input()

    def write_input(self) -> None:
        while self.outq and self.master >= 0:
            buf = self.outq[0]
            try:
                n = os.write(self.master, buf)
            except BlockingIOError:
                self.loop.set_writer(self.master, self.write_input)
                return
            except OSError:
                while self.outq:
                    self.ack(len(self.outq.popleft()))
                return
            self.ack(n)
            if n == len(buf):
                self.outq.popleft()
            else:
                self.outq[0] = buf[n:]
        if self.master >= 0:
            self.loop.del_writer(self.master)

    def on_event(self, obj: JsonObj) -> None:
        if obj.get("type") == "resize" and self.master >= 0:
            try:
                self._winsize(self.master, int(obj["rows"]), int(obj["cols"]))
            except Exception as e:
                self.sess.send_error(self.sid, INVALID, "resize failed: %s" % e)
        elif obj.get("type") == "signal" and self.status is None:
            sig = obj.get("signal")
            if isinstance(sig, int):
                _kill(self.child.pid, sig)


# --- files ----------------------------------------------------------------------------------


def file_info(path: str, st: Optional[os.stat_result] = None) -> JsonObj:
    if st is None:
        st = os.lstat(path)
    mode = st.st_mode
    if _stat.S_ISREG(mode):
        kind = "file"
    elif _stat.S_ISDIR(mode):
        kind = "dir"
    elif _stat.S_ISLNK(mode):
        kind = "symlink"
    else:
        kind = "other"
    name = os.path.basename(path.rstrip("/")) or "/"
    info: JsonObj = {
        "path": path,
        "name": name,
        "type": kind,
        "size": st.st_size,
        "mode": _stat.S_IMODE(mode),
        "mtime": st.st_mtime,
        "target": None,
    }
    if kind == "symlink":
        try:
            info["target"] = os.readlink(path)
        except OSError:
            info["target"] = None
    return info


def _readable_kind(path: str, mode: int) -> None:
    """Raise INVALID unless ``mode`` is a regular file's."""
    if _stat.S_ISREG(mode):
        return
    if _stat.S_ISDIR(mode):
        raise AgentError(INVALID, "%s: is a directory" % path, errno="EISDIR")
    kind = "a device" if _stat.S_ISCHR(mode) or _stat.S_ISBLK(mode) else "a special file"
    raise AgentError(INVALID, "%s: is %s, not a regular file: it cannot be read" % (path, kind))


_PSEUDO_ROOTS = ("/proc", "/sys")


def _on_pseudo_fs(fd: int) -> bool:
    """Whether ``fd`` is a file of procfs or sysfs (whose reads may fail by design)."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return False
    for root in _PSEUDO_ROOTS:
        try:
            if os.stat(root).st_dev == dev:
                return True
        except OSError:
            pass
    return False


class FileRead(Stream):
    """``file.read``: a regular file's bytes from an offset; with ``follow``, tail it."""

    def __init__(self, sess: Session, sid: int, req: JsonObj) -> None:
        self.path = req_path(req)
        offset = req_int(req, "offset", 0) or 0
        if offset < 0:
            msg = '"offset" must be >= 0'
            raise _bad(msg)
        self.follow = bool(req.get("follow"))
        self.nofollow = bool(req.get("nofollow"))
        self.fd = self._open()
        st = os.fstat(self.fd)
        self.ino = (st.st_dev, st.st_ino)
        self.pos = offset
        Stream.__init__(self, sess, sid)
        self.loop = sess.loop
        self.timer: Optional[Timer] = None
        self.scheduled = False
        self.pump()

    def _open(self) -> int:
        # Checked before the open too: opening a device can fail (/dev/tty without a
        # controlling terminal: ENXIO) or act (a tape rewinds), and neither is a read. A link
        # met with nofollow is left to the open, which refuses it as a swapped path.
        mode = os.stat(self.path, follow_symlinks=not self.nofollow).st_mode
        if not _stat.S_ISLNK(mode):
            _readable_kind(self.path, mode)
        if self.nofollow:
            fd = _open_nofollow(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        else:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            _readable_kind(self.path, os.fstat(fd).st_mode)
        except AgentError:
            os.close(fd)
            raise
        return fd

    def pump(self) -> None:
        self.scheduled = False
        if self.done or self.fd < 0:
            return
        for _ in range(16):
            n = min(FILE_CHUNK, self.credit)
            if n <= 0 or not self.can_send(1):
                return
            try:
                data = os.pread(self.fd, n, self.pos)
            except OSError as e:
                pseudo = _on_pseudo_fs(self.fd)
                self.close_fd()
                err = os_error(e, self.path)
                if pseudo:
                    # /proc/<pid>/mem and kin open as regular files but refuse plain reads
                    # (EIO at unmapped offsets): the request's fault, not a broken sandbox.
                    err = AgentError(
                        INVALID,
                        "%s: cannot be read through the file API (%s)" % (self.path, e.strerror),
                        **err.details,
                    )
                self.fail(err.code, err.message, **err.details)
                return
            if not data:
                self.at_eof()
                return
            self.pos += len(data)
            self.data(CH_OUT, data)
        self.scheduled = True
        self.loop.call_soon(self.pump)

    def at_eof(self) -> None:
        if not self.follow:
            self.close_fd()
            self.finish({"size": self.pos})
            return
        self.timer = self.loop.call_later(FOLLOW_POLL, self.poll)

    def poll(self) -> None:
        self.timer = None
        if self.done:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) != self.ino and _stat.S_ISREG(st.st_mode):
            # The file was replaced (rotated or rewritten): follow the new one from its start.
            try:
                fd = self._open()
            except (OSError, AgentError):
                fd = -1
            if fd >= 0:
                self.close_fd()
                self.fd = fd
                self.ino = (st.st_dev, st.st_ino)
                self.pos = 0
                self.event({"type": "reopened"})
        elif st is not None and st.st_size < self.pos:
            self.pos = 0
            self.event({"type": "truncated"})
        self.pump()

    def on_credit(self) -> None:
        if not self.scheduled and self.timer is None:
            self.pump()

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.close_fd()


class FileWrite(Stream):
    """``file.write``: DATA on chan 0 into a temp file, renamed over the path at EOF."""

    def __init__(self, sess: Session, sid: int, req: JsonObj) -> None:
        path = req_path(req)
        mode = req_int(req, "mode")
        if mode is not None and not 0 <= mode <= 0o7777:
            msg = '"mode" must be within 0..0o7777'
            raise _bad(msg)
        if path.endswith("/"):
            msg = "%s: names a directory" % path
            raise _bad(msg)
        parent, name = os.path.split(path)
        # With nofollow every name is relative to the parent's descriptor (dfd), opened
        # without following links; otherwise dfd is None and names are whole paths.
        self.dfd: Optional[int] = None
        if req.get("nofollow"):
            parts = _path_parts(path)
            if not parts:
                raise AgentError(INVALID, "%s: is a directory" % path, errno="EISDIR")
            self.dfd = open_dir_nofollow(path, parts[:-1], create=True)
            name = parts[-1]
        try:
            self.target = name if self.dfd is not None else path
            try:
                # A link in the last place is replaced, not followed (the rename below).
                st = os.stat(self.target, dir_fd=self.dfd, follow_symlinks=self.dfd is None)
            except FileNotFoundError:
                st = None
            if st is not None and _stat.S_ISDIR(st.st_mode):
                raise AgentError(INVALID, "%s: is a directory" % path, errno="EISDIR")
            if st is not None and _stat.S_ISLNK(st.st_mode):
                st = None
            if mode is None:
                mode = _stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~sess.agent.umask
            if self.dfd is None:
                os.makedirs(parent or "/", exist_ok=True)
            tmp = ".%s.sandlot-%s-%d.tmp" % (name[:200], sess.agent.boot, sid)
            self.tmp = tmp if self.dfd is not None else os.path.join(parent, tmp)
            self.fd = os.open(
                self.tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
                dir_fd=self.dfd,
            )
        except BaseException:
            self.close_dfd()
            raise
        self.path = path
        self.mode = mode
        self.size = 0
        Stream.__init__(self, sess, sid)

    def on_data(self, chan: int, data: memoryview) -> None:
        if self.fd < 0:
            self.ack(len(data))
            return
        try:
            view = data
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as e:
            self.abort()
            err = os_error(e, self.path)
            self.fail(err.code, err.message, **err.details)
            return
        self.size += len(data)
        self.ack(len(data))

    def on_eof(self, chan: int) -> None:
        if self.fd < 0 or self.done:
            return
        try:
            os.fchmod(self.fd, self.mode)
            os.close(self.fd)
            self.fd = -1
            os.rename(self.tmp, self.target, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
            st = os.stat(self.target, dir_fd=self.dfd, follow_symlinks=False)
            info = file_info(self.path, st)
        except OSError as e:
            self.abort()
            err = os_error(e, self.path)
            self.fail(err.code, err.message, **err.details)
            return
        self.close_dfd()
        self.finish(info)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            if self.dfd is None:
                _ignore(os.unlink, self.tmp)
            else:
                _ignore(_unlink_at, self.tmp, self.dfd)
        self.close_dfd()

    def close_dfd(self) -> None:
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None


MAX_LINKS = 40  # as the kernel's MAXSYMLINKS
_DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def resolve_path(path: str, follow_last: bool) -> str:
    """``path`` with every symlink resolved inside this root, as the kernel would.

    ``/`` is the sandbox's own root, so an absolute link target starts over from it and ``..``
    stops at it: no link leads out. What does not exist (yet) is kept as written. Without
    ``follow_last`` a link in the last place is kept: the operation acts on the link itself.
    """
    todo = [c for c in path.split("/") if c]
    todo.reverse()
    parts: List[str] = []
    links = 0
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            if parts:
                parts.pop()
            continue
        here = "/" + "/".join([*parts, name])
        try:
            st = os.lstat(here)
        except OSError:
            parts.append(name)  # not there (yet): the operation itself says why if it matters
            continue
        if _stat.S_ISLNK(st.st_mode) and (todo or follow_last):
            links += 1
            if links > MAX_LINKS:
                raise AgentError(
                    INVALID,
                    "%s: too many levels of symbolic links" % path,
                    errno="ELOOP",
                    path=path,
                )
            target = os.readlink(here)
            if target.startswith("/"):
                parts = []
            todo.extend(reversed([c for c in target.split("/") if c]))
            continue
        parts.append(name)
    return "/" + "/".join(parts)


def _path_parts(path: str) -> List[str]:
    parts = [c for c in path.split("/") if c]
    if "." in parts or ".." in parts:
        msg = "%s: not a resolved path (contains . or ..)" % path
        raise _bad(msg)
    return parts


def open_dir_nofollow(path: str, parts: List[str], create: bool = False) -> int:
    """A descriptor of the directory ``/parts...``, opened one component at a time without
    following a symlink: the path the host decided on is the path acted on, even when a link is
    swapped in after the decision (that is an error, never a detour)."""
    fd = os.open("/", _DIR_NOFOLLOW)
    try:
        for i, name in enumerate(parts):
            try:
                nfd = os.open(name, _DIR_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                _ignore(_mkdir_at, name, fd)  # lost a race to create it: fine, open it
                nfd = os.open(name, _DIR_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, name):
                    raise _moved(path, "/" + "/".join(parts[: i + 1])) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mkdir_at(name: str, dfd: int) -> None:
    os.mkdir(name, 0o777, dir_fd=dfd)


def _unlink_at(name: str, dfd: int) -> None:
    os.unlink(name, dir_fd=dfd)


def _is_link(dfd: int, name: str) -> bool:
    try:
        return _stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _moved(path: str, link: str) -> AgentError:
    return AgentError(
        CONFLICT,
        "%s: %s is a symbolic link now; the path changed after it was resolved, ask again"
        % (path, link),
        errno="ELOOP",
        path=path,
    )


def _open_nofollow(path: str, flags: int) -> int:
    parts = _path_parts(path)
    if not parts:
        return os.open("/", flags | os.O_NOFOLLOW)
    dfd = open_dir_nofollow(path, parts[:-1])
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _moved(path, path) from None
        raise
    finally:
        os.close(dfd)


def rmtree(path: str) -> None:
    """Remove a tree without following symlinks (a planted link removes only itself)."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _rm_contents(dfd)
    finally:
        os.close(dfd)
    os.rmdir(path)


def _rm_contents(dfd: int) -> None:
    for entry in list(os.scandir(dfd)):
        name = entry.name
        if entry.is_dir(follow_symlinks=False):
            sub = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd
            )
            try:
                _rm_contents(sub)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dfd)
        else:
            os.unlink(name, dir_fd=dfd)


# --- operations -----------------------------------------------------------------------------


def op_exec(sess: Session, sid: int, req: JsonObj) -> None:
    Exec(sess, sid, req)


def op_pty_open(sess: Session, sid: int, req: JsonObj) -> None:
    Pty(sess, sid, req)


def op_proc_start(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    agent = sess.agent
    name = req_str(req, "name")
    if name is not None:
        for p in agent.procs.values():
            if p.name == name and not p.finalized:
                raise AgentError(
                    CONFLICT, "a running process is already named %r (%s)" % (name, p.id)
                )
    agent.counter += 1
    proc = BgProcess(agent, "p-%s-%d" % (agent.boot, agent.counter), req)
    agent.procs[proc.id] = proc
    return proc.info()


def op_proc_list(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    return {"processes": [p.info() for p in sess.agent.procs.values()]}


def op_proc_signal(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    proc = sess.agent.find_proc(req)
    sig = req_int(req, "signal")
    if sig is None or not 0 < sig < 65:
        msg = '"signal" must be a signal number'
        raise _bad(msg)
    if proc.status is not None:
        raise AgentError(BAD_STATE, "process %s has exited" % proc.id)
    return {"signalled": proc.child.kill(sig)}


def op_proc_wait(sess: Session, sid: int, req: JsonObj) -> Optional[JsonObj]:
    proc = sess.agent.find_proc(req)
    if proc.finalized:
        return proc.info()
    ProcWait(sess, sid, proc, req_num(req, "timeout"))
    return None


def op_proc_output(sess: Session, sid: int, req: JsonObj) -> None:
    proc = sess.agent.find_proc(req)
    offset = req_int(req, "offset", 0) or 0
    ProcOutput(sess, sid, proc, max(0, offset), bool(req.get("follow")))


def op_proc_stdin(sess: Session, sid: int, req: JsonObj) -> None:
    proc = sess.agent.find_proc(req)
    if proc.in_fd < 0:
        raise AgentError(BAD_STATE, "stdin of %s is closed" % proc.id)
    ProcStdin(sess, sid, proc, bool(req.get("close")))


def op_file_read(sess: Session, sid: int, req: JsonObj) -> None:
    FileRead(sess, sid, req)


def op_file_write(sess: Session, sid: int, req: JsonObj) -> None:
    FileWrite(sess, sid, req)


def op_file_stat(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    return file_info(req_path(req))


def op_file_list(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    path = req_path(req)
    base = path if path.endswith("/") else path + "/"
    # With nofollow the directory is opened one component at a time, no link followed.
    dfd = open_dir_nofollow(path, _path_parts(path)) if req.get("nofollow") else None
    entries = []
    try:
        with os.scandir(path if dfd is None else dfd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                entries.append(file_info(base + entry.name, st))
    finally:
        if dfd is not None:
            os.close(dfd)
    return _send_entries(sess, sid, entries)


def _send_entries(sess: Session, sid: int, entries: List[JsonObj]) -> JsonObj:
    entries.sort(key=lambda e: e["name"])
    # Large directories go out in several EVENT frames so no frame nears the size limit.
    for i in range(0, len(entries), 1000):
        sess.send(T_EVENT, sid, dumps({"type": "entries", "entries": entries[i : i + 1000]}))
    return {"count": len(entries)}


def op_file_mkdir(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    path = req_path(req)
    mode = req_int(req, "mode", 0o777)
    os.makedirs(path, mode=mode or 0o777, exist_ok=True)
    return file_info(path)


def op_file_remove(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    path = req_path(req)
    if os.path.normpath(path) == "/":
        msg = "refusing to remove /"
        raise _bad(msg)
    if req.get("nofollow"):
        parts = _path_parts(path)
        dfd = open_dir_nofollow(path, parts[:-1])
        try:
            _remove_at(dfd, parts[-1], bool(req.get("recursive")))
        finally:
            os.close(dfd)
        return {}
    st = os.lstat(path)
    if _stat.S_ISDIR(st.st_mode):
        if req.get("recursive"):
            rmtree(path)
        else:
            os.rmdir(path)
    else:
        os.unlink(path)
    return {}


def _remove_at(dfd: int, name: str, recursive: bool) -> None:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if not _stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    if recursive:
        sub = os.open(name, _DIR_NOFOLLOW, dir_fd=dfd)
        try:
            _rm_contents(sub)
        finally:
            os.close(sub)
    os.rmdir(name, dir_fd=dfd)


def op_file_resolve(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    return {"path": resolve_path(req_path(req), req.get("follow_last", True) is not False)}


def op_file_chmod(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    path = req_path(req)
    mode = req_int(req, "mode")
    if mode is None or not 0 <= mode <= 0o7777:
        msg = '"mode" must be within 0..0o7777'
        raise _bad(msg)
    os.chmod(path, mode)
    return file_info(path)


def op_info(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    return sess.agent.hello(PROTOCOL_VERSION)


def op_clock_set(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    # A VM restored from a memory snapshot resumes with the clock of the instant the snapshot
    # was taken. Setting it here costs one syscall; a ``date -s`` exec would start two programs,
    # which under TCG emulation is most of a restore's latency.
    when = req_num(req, "time")
    if when is None:
        msg = '"time" (seconds since the epoch) is required'
        raise _bad(msg)
    time.clock_settime(time.CLOCK_REALTIME, when)
    return {"time": time.time()}


def op_session_detach(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    # The host is about to hang up and save the VM's memory: once this reply is out, the
    # session ends (its streams are cancelled) and the next bytes on the device belong to a new
    # session. So a saved VM always holds an agent waiting for a new host's HELLO, which the
    # host knows from this reply alone (QEMU's port events are rate-limited).
    sess.detach_when_flushed = True
    return {}


def op_fd_count(sess: Session, sid: int, req: JsonObj) -> JsonObj:
    # Open descriptors of every process but the agent's own (those depend on how many host
    # connections are open at the instant). A reset's verification compares this with the
    # count at the baseline: a process left behind, or a file it holds open, changes it.
    # Counted here rather than by a shell script: under TCG emulation the first program a
    # restored VM starts costs ~200 ms of code translation, most of a reset's budget.
    me = str(os.getpid())
    count = processes = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            count += len(os.listdir("/proc/%s/fd" % name))
        except OSError:
            continue  # it exited between the two listings
        processes += 1
    return {"count": count, "processes": processes}


if TYPE_CHECKING:
    Handler = Callable[[Session, int, JsonObj], Optional[JsonObj]]

OPS: Dict[str, Handler] = {
    "exec": op_exec,
    "proc.start": op_proc_start,
    "proc.list": op_proc_list,
    "proc.signal": op_proc_signal,
    "proc.wait": op_proc_wait,
    "proc.output": op_proc_output,
    "proc.stdin": op_proc_stdin,
    "pty.open": op_pty_open,
    "file.read": op_file_read,
    "file.write": op_file_write,
    "file.stat": op_file_stat,
    "file.list": op_file_list,
    "file.mkdir": op_file_mkdir,
    "file.remove": op_file_remove,
    "file.chmod": op_file_chmod,
    "file.resolve": op_file_resolve,
    "agent.info": op_info,
    "clock.set": op_clock_set,
    "fd.count": op_fd_count,
    "session.detach": op_session_detach,
}


# --- the agent ------------------------------------------------------------------------------


class Agent:
    def __init__(self, workdir: Optional[str], env_file: Optional[str]) -> None:
        self.loop = Loop()
        self.reaper = Reaper()
        self.boot = os.urandom(4).hex()
        self.counter = 0
        self.tokens = 0
        self.pid1 = os.getpid() == 1
        self.sessions: set[Session] = set()
        self.procs: Dict[str, BgProcess] = {}
        self.stdin_streams: set[ProcStdin] = set()
        self.listeners: List[Any] = []
        self.socket_paths: List[str] = []
        self.stdio = False
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.default_env = dict(os.environ)
        if env_file is not None:
            with open(env_file, "rb") as f:
                extra = loads(f.read())
            if not isinstance(extra, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in extra.items()
            ):
                raise SystemExit("sandlot-agent: %s must hold a JSON object of strings" % env_file)
            self.default_env.update(extra)
        self.default_env.setdefault("PATH", DEFAULT_PATH)
        self.workdir = os.path.abspath(workdir) if workdir else os.getcwd()
        # The agent's own cwd is /, so that nothing it does pins a directory of the sandbox.
        os.chdir("/")
        try:
            self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            r, w = os.pipe()
            os.close(w)
            self.devnull = r
        self.oom_file = self._find_oom_file()

    @staticmethod
    def _find_oom_file() -> Optional[str]:
        path = "/sys/fs/cgroup/memory.events"
        return path if os.path.exists(path) else None

    def oom_count(self) -> int:
        """The cgroup's oom_kill counter (best effort: 0 when it cannot be read)."""
        if self.oom_file is None:
            return 0
        try:
            with open(self.oom_file, "rb") as f:
                for line in f.read().splitlines():
                    if line.startswith(b"oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def hello(self, version: int) -> JsonObj:
        return {
            "protocol": version,
            "agent": "sandlot-agent",
            "version": AGENT_VERSION,
            "pid": os.getpid(),
            "pid1": self.pid1,
            "uid": os.getuid(),
            "python": "%d.%d.%d" % sys.version_info[:3],
            "boot_id": self.boot,
            "workdir": self.workdir,
            "window": WINDOW,
            "max_payload": MAX_PAYLOAD,
            "max_data": MAX_DATA,
            "ops": sorted(OPS),
        }

    # spawning
    def resolve(self, prog: str, path_var: str, cwd: str) -> str:
        if "/" in prog:
            return prog
        denied = None
        for d in path_var.split(":"):
            cand = os.path.join(d or ".", prog)
            if not cand.startswith("/"):
                cand = os.path.join(cwd, cand)
            try:
                st = os.stat(cand)
            except OSError:
                continue
            if _stat.S_ISREG(st.st_mode):
                if os.access(cand, os.X_OK):
                    return cand
                denied = cand
        if denied is not None:
            raise SpawnFailed(126, "%s: permission denied" % denied)
        raise SpawnFailed(127, "%s: command not found" % prog)

    def spawn(
        self,
        argv: List[str],
        cwd: Optional[str],
        env: Dict[str, str],
        fds: Optional[Tuple[int, int, int]],
        tty: Optional[str] = None,
    ) -> Child:
        """Start a command in its own session, tagged with a fresh marker.

        Spawned with posix_spawn (vfork+exec in glibc), which is what keeps an exec's overhead
        near a bare ``subprocess.run``. posix_spawn has no chdir, so the agent changes its own
        directory around the call; it is single-threaded, so nothing else can observe that.
        """
        cwd = os.path.join(self.workdir, cwd) if cwd else self.workdir
        self.tokens += 1
        token = "%s-%d" % (self.boot, self.tokens)
        full = dict(self.default_env)
        full.update(env)
        full[MARKER] = token
        path = self.resolve(argv[0], full.get("PATH", DEFAULT_PATH), cwd)
        if tty is not None:
            # After setsid, opening the terminal by name makes it the controlling terminal.
            actions = [
                (os.POSIX_SPAWN_OPEN, 0, tty, os.O_RDWR, 0),
                (os.POSIX_SPAWN_DUP2, 0, 1),
                (os.POSIX_SPAWN_DUP2, 0, 2),
            ]
        else:
            assert fds is not None
            actions = [
                (os.POSIX_SPAWN_DUP2, fds[0], 0),
                (os.POSIX_SPAWN_DUP2, fds[1], 1),
                (os.POSIX_SPAWN_DUP2, fds[2], 2),
            ]
        try:
            os.chdir(cwd)
        except OSError as e:
            raise AgentError(
                NOT_FOUND if e.errno == errno.ENOENT else INVALID,
                "working directory %s: %s" % (cwd, e.strerror),
                errno=errno.errorcode.get(e.errno or 0, "E?"),
            ) from None
        try:
            pid = self._posix_spawn(path, argv, full, actions)
        except OSError as e:
            code = 127 if e.errno == errno.ENOENT else 126
            raise SpawnFailed(code, "%s: %s" % (argv[0], e.strerror)) from None
        finally:
            os.chdir("/")
        return Child(pid, token)

    def _posix_spawn(
        self, path: str, argv: List[str], env: Dict[str, str], actions: List[Any]
    ) -> int:
        # EAGAIN means the sandbox's process limit is reached. Right after a runaway tree was
        # killed (a fork bomb's timeout) its processes are still going away, so reap and try
        # again for up to a second before reporting it.
        deadline = time.monotonic() + 1.0
        while True:
            try:
                return os.posix_spawn(
                    path, argv, env, file_actions=actions, setsid=True, setsigdef=_SIGDEF
                )
            except OSError as e:
                if e.errno != errno.EAGAIN or time.monotonic() >= deadline:
                    raise
            self.reaper.reap()
            time.sleep(0.01)

    # processes
    def find_proc(self, req: JsonObj) -> BgProcess:
        key = req.get("id")
        if not isinstance(key, str):
            msg = '"id" must be a string'
            raise _bad(msg)
        proc = self.procs.get(key)
        if proc is None:
            named = [p for p in self.procs.values() if p.name == key]
            if named:
                proc = named[-1]
        if proc is None:
            raise AgentError(NOT_FOUND, "no process %r" % key, id=key)
        return proc

    def retire(self) -> None:
        exited = [p for p in self.procs.values() if p.finalized and not p.subs]
        for p in exited[: max(0, len(exited) - KEEP_EXITED)]:
            del self.procs[p.id]

    # serving
    def listen_fd(self, fd: int) -> None:
        import _socket

        os.set_inheritable(fd, False)
        sock = _socket.socket(fileno=fd)
        self._serve_socket(sock)

    def listen_path(self, path: str) -> None:
        import _socket

        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        _ignore(os.unlink, tmp)
        old = os.umask(0o177)
        try:
            sock.bind(tmp)
        finally:
            os.umask(old)
        sock.listen(128)
        # Renamed into place only once listening: the path existing means "connectable".
        os.rename(tmp, path)
        self.socket_paths.append(path)
        self._serve_socket(sock)

    def _serve_socket(self, sock: Any) -> None:
        sock.setblocking(False)
        self.listeners.append(sock)
        fd = sock.fileno()

        def on_accept() -> None:
            for _ in range(64):
                try:
                    cfd, _addr = sock._accept()
                except BlockingIOError:
                    return
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        log("accept failed: %s" % e)
                        return
                    if e.errno in (errno.ECONNABORTED, errno.EINTR):
                        continue
                    raise
                _grow_buffers(cfd)
                self.sessions.add(Session(self, cfd, cfd, self._dropped))

        self.loop.set_reader(fd, on_accept)

    def _dropped(self, sess: Session) -> None:
        self.sessions.discard(sess)

    def serve_stdio(self) -> None:
        self.stdio = True
        rfd = os.dup(0)
        wfd = os.dup(1)
        os.set_inheritable(rfd, False)
        os.set_inheritable(wfd, False)

        def done(sess: Session) -> None:
            self.sessions.discard(sess)
            self.shutdown("end of stdin")

        self.sessions.add(Session(self, rfd, wfd, done))

    def serve_device(self, path: str) -> None:
        delay = 0.005
        # The device, registered edge-triggered: this epoll becomes readable when the port
        # changes (the guest's virtio-console driver wakes a port's pollers when a host
        # connects), so waiting for a host costs neither polling latency nor idle CPU.
        changes = select.epoll()
        safety: Optional[Timer] = None

        def open_device() -> None:
            nonlocal delay
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as e:
                if delay >= 0.02:
                    log("cannot open %s: %s; retrying" % (path, e))
                delay = min(1.0, delay * 2)
                self.loop.call_later(delay, open_device)
                return
            delay = 0.005
            if os.isatty(fd):
                import termios
                import tty

                # TCSANOW: bytes the host already sent must not be flushed away.
                tty.setraw(fd, termios.TCSANOW)
            try:
                changes.register(fd, select.EPOLLIN | select.EPOLLOUT | select.EPOLLET)
            except FileExistsError:  # closing the old descriptor should have removed it
                changes.modify(fd, select.EPOLLIN | select.EPOLLOUT | select.EPOLLET)
            wait_for_host(fd, b"")

        def wait_for_host(fd: int, leftover: bytes) -> None:
            # While the host side is away the port reports a hang-up and reads end-of-file at
            # once, so it is not read but kept open until a host is there: closing it would
            # throw away what a host sent between that end-of-file and the close (its HELLO,
            # which it would then wait a whole handshake timeout to repeat).
            nonlocal safety
            if safety is not None:
                safety.cancel()
                safety = None
            changes.poll(0)  # consumed: only a change after this look wakes us again
            if _hung_up(fd):
                self.loop.set_reader(changes.fileno(), lambda: wait_for_host(fd, b""))
                # And a slow look of our own, should a port not wake its pollers.
                safety = self.loop.call_later(1.0, lambda: wait_for_host(fd, b""))
                return
            self.loop.del_reader(changes.fileno())
            sess = Session(self, fd, fd, closed, keep_fds=True)
            self.sessions.add(sess)
            if leftover:
                sess.parse(leftover)

        def closed(sess: Session) -> None:
            self.sessions.discard(sess)
            if not sess.keep_fds:  # reading or writing it failed: it was closed
                self.loop.call_later(0.005, open_device)
            else:
                # The next session starts from the loop, not inside this one's parsing.
                fd, leftover = sess.rfd, sess.leftover
                self.loop.call_soon(lambda: wait_for_host(fd, leftover))

        open_device()

    def on_signals(self, rfd: int) -> None:
        try:
            data = os.read(rfd, 512)
        except OSError:
            return
        if _signal.SIGTERM in data or _signal.SIGINT in data:
            self.shutdown("signal")
            return
        self.reaper.reap()

    def shutdown(self, why: str) -> None:
        """Kill every process this agent started (all of the namespace when PID 1) and exit."""
        for sess in list(self.sessions):
            sess.close("agent shutting down")
        if self.pid1:
            _kill(-1, 9)
        else:
            roots = [p.child.pid for p in self.procs.values() if p.status is None]
            needle = ("\0%s=%s-" % (MARKER, self.boot)).encode()
            kill_tree(roots, needle, 9, parents=(os.getpid(),))
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.005)
        for path in self.socket_paths:
            _ignore(os.unlink, path)
        self.loop.stopping = True

    def run(self, signal_fd: int) -> None:
        self.loop.set_reader(signal_fd, lambda: self.on_signals(signal_fd))
        # Children that exited before the handler was installed still need reaping.
        self.reaper.reap()
        self.loop.run()


def _hung_up(fd: int) -> bool:
    """Whether the peer of a device (a virtio-serial port's host side) is away."""
    probe = select.poll()
    probe.register(fd, select.POLLIN)
    return any(events & select.POLLHUP for _, events in probe.poll(0))


def _grow_buffers(fd: int) -> None:
    # Bigger socket buffers mean fewer wakeups per MiB moved (unix sockets default to ~200 KiB).
    import _socket

    try:
        s = _socket.socket(fileno=fd)
    except OSError:
        return
    try:
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, SOCKET_BUFFER)
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, SOCKET_BUFFER)
    except OSError:
        pass
    finally:
        s.detach()


def _noop(signum: int, frame: object) -> None:
    pass


def become_subreaper() -> bool:
    """Make orphans of our descendants re-parent to us instead of the real init."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(36, 1, 0, 0, 0)) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def catch_signals() -> int:
    """Route SIGCHLD, SIGTERM and SIGINT to a pipe the loop watches; returns its read end.

    Installed first thing, so a SIGTERM that arrives while the agent is still starting is not
    lost (it is handled as soon as the loop runs) and never kills the agent uncleanly.
    """
    rfd, wfd = os.pipe()
    for fd in (rfd, wfd):
        os.set_blocking(fd, False)
    _signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    for sig in (_signal.SIGCHLD, _signal.SIGTERM, _signal.SIGINT):
        _signal.signal(sig, _noop)
    return rfd


def ensure_std_fds() -> None:
    # Pipes must never get fds 0-2, or the dup2 file actions of a spawn would clobber them.
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            nfd = os.open("/dev/null", os.O_RDWR)
            if nfd != fd:
                os.dup2(nfd, fd)
                os.close(nfd)


USAGE = """usage: agent.py (--listen-fd N | --listen PATH | --device PATH | --stdio)
                [--workdir DIR] [--env-file FILE] [--quiet]"""


def parse_args(argv: List[str]) -> Dict[str, Any]:
    opts: Dict[str, Any] = {"listen_fd": [], "listen": [], "device": None, "stdio": False}
    i = 0
    takes = {"--listen-fd", "--listen", "--device", "--workdir", "--env-file"}
    while i < len(argv):
        a = argv[i]
        val = None
        if "=" in a and a.split("=", 1)[0] in takes:
            a, val = a.split("=", 1)
        elif a in takes:
            i += 1
            if i >= len(argv):
                raise SystemExit("%s needs a value\n%s" % (a, USAGE))
            val = argv[i]
        i += 1
        if a == "--listen-fd":
            assert val is not None
            if not val.isdigit():
                raise SystemExit("--listen-fd needs a number\n%s" % USAGE)
            opts["listen_fd"].append(int(val))
        elif a == "--listen":
            opts["listen"].append(val)
        elif a == "--device":
            opts["device"] = val
        elif a == "--stdio":
            opts["stdio"] = True
        elif a in ("--workdir", "--env-file"):
            opts[a[2:].replace("-", "_")] = val
        elif a == "--quiet":
            opts["quiet"] = True
        elif a in ("-h", "--help"):
            sys.stdout.write(USAGE + "\n")
            raise SystemExit(0)
        else:
            raise SystemExit("unknown argument %r\n%s" % (a, USAGE))
    modes = bool(opts["listen_fd"] or opts["listen"]) + bool(opts["device"]) + opts["stdio"]
    if modes != 1:
        raise SystemExit("choose exactly one of --listen-fd/--listen, --device, --stdio\n" + USAGE)
    return opts


def main(argv: Optional[List[str]] = None) -> int:
    global _quiet
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    _quiet = bool(opts.get("quiet"))
    ensure_std_fds()
    signal_fd = catch_signals()
    agent = Agent(opts.get("workdir"), opts.get("env_file"))
    if not agent.pid1 and not become_subreaper():
        log("could not become a child subreaper; orphans go to the real init")
    for fd in opts["listen_fd"]:
        agent.listen_fd(fd)
    for path in opts["listen"]:
        agent.listen_path(path)
    if opts["device"]:
        agent.serve_device(opts["device"])
    if opts["stdio"]:
        agent.serve_stdio()
    agent.run(signal_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
