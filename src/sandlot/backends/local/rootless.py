"""Rootless mode of the local backend: what changes when the caller is a normal user.

Root inside a rootless sandbox is the caller. When ``/etc/subuid`` and ``/etc/subgid`` give the
caller a range of at least 65,535 ids and ``newuidmap``/``newgidmap`` (Debian package
``uidmap``) are installed, ids ``1..65535`` inside are that range, so a sandbox has the same
65,536 ids as a rootful one; otherwise the caller is its only id (:class:`IdMap`).

An unprivileged user cannot mount on the host, so the root overlay is mounted by
:mod:`.userns_helper` in a user and mount namespace of its own, from which it runs the runtime;
the sandbox's own namespaces (a user namespace among them) are made inside that one, and the
overlay exists only there: nothing is left in the host's mount table. Files a sandbox made
belong to the caller's subordinate ids on the host, so reading or removing them all takes a
process with capabilities in such a namespace (:func:`run_op`, :func:`remove_trees`).

What rootless cannot do on a host without delegated cgroups (a cgroup v1/v2 hybrid has none for
normal users): enforce memory, pids or CPU limits, count a sandbox's processes by cgroup (they
are found from its init instead: :func:`sandbox_pids`), or freeze it through the freezer (a
snapshot stops its processes with ``SIGSTOP`` instead: :func:`freeze`). Outbound network is
``slirp4netns`` in user mode (:func:`start_slirp`). This module imports only
:mod:`sandlot.errors`, :mod:`.runtime`, the network pool's default and the standard library; it must not import the rest of
the backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandlot.backends.local.runtime import process_alive, reap
from sandlot.errors import BackendError, BackendUnavailable
from sandlot.network.netns import configured_pool

__all__ = [
    "HELPER",
    "SLIRP_DNS",
    "IdMap",
    "compile_helper",
    "detect",
    "fence_slirp",
    "freeze",
    "helper_argv",
    "remove_trees",
    "run_op",
    "runtime_base",
    "sandbox_pids",
    "slirp_problem",
    "start_slirp",
    "stop_slirp",
    "thaw",
]

HELPER = Path(__file__).with_name("userns_helper.py")
"""The stdlib-only script that enters a rootless sandbox's user namespace."""
_LAYERS_PY = Path(__file__).with_name("layers.py")
_ERRORS_PY = Path(__file__).parent.parent.parent / "errors.py"
_FULL = 65536
SLIRP_DNS = "10.0.2.3"
"""The resolver slirp4netns offers inside (it forwards to the host's own nameservers)."""


@dataclass(frozen=True)
class IdMap:
    """How a rootless sandbox's ids map to the host: root is the caller; with subordinate
    ranges, ids ``1..65535`` are the first 65,535 of them."""

    uid: int
    gid: int
    sub_uid: int | None = None
    sub_gid: int | None = None

    @property
    def full(self) -> bool:
        """True when the sandbox has 65,536 ids (subordinate ranges), False for one."""
        return self.sub_uid is not None and self.sub_gid is not None

    @property
    def size(self) -> int:
        """How many ids a sandbox has."""
        return _FULL if self.full else 1

    @property
    def key(self) -> str:
        """A name for this mapping (layers stored under one cannot serve another)."""
        if self.full:
            return f"rootless-{self.uid}-{self.gid}-{self.sub_uid}-{self.sub_gid}"
        return f"rootless-{self.uid}-{self.gid}"

    def uid_ranges(self) -> list[tuple[int, int, int]]:
        """``(first id inside, first id on the host, count)`` for uids."""
        out = [(0, self.uid, 1)]
        if self.full:
            assert self.sub_uid is not None
            out.append((1, self.sub_uid, _FULL - 1))
        return out

    def gid_ranges(self) -> list[tuple[int, int, int]]:
        """``(first id inside, first id on the host, count)`` for gids."""
        out = [(0, self.gid, 1)]
        if self.full:
            assert self.sub_gid is not None
            out.append((1, self.sub_gid, _FULL - 1))
        return out

    def host_uid(self, inside: int) -> int | None:
        """The host uid of ``inside`` (None when it is not mapped)."""
        for first, host, count in self.uid_ranges():
            if first <= inside < first + count:
                return host + inside - first
        return None

    def to_json(self) -> dict[str, int | None]:
        """For the sandbox's record."""
        return {"uid": self.uid, "gid": self.gid, "sub_uid": self.sub_uid, "sub_gid": self.sub_gid}

    @classmethod
    def from_json(cls, doc: Mapping[str, object]) -> IdMap:
        """The inverse of :meth:`to_json`."""

        def opt(key: str) -> int | None:
            value = doc.get(key)
            return int(value) if isinstance(value, int) else None

        return cls(int(str(doc["uid"])), int(str(doc["gid"])), opt("sub_uid"), opt("sub_gid"))


def _subid_start(path: str, names: set[str]) -> int | None:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.strip().split(":")
        if (
            len(parts) == 3
            and parts[0] in names
            and parts[1].isdigit()
            and parts[2].isdigit()
            and int(parts[2]) >= _FULL - 1
        ):
            return int(parts[1])
    return None


def detect() -> tuple[IdMap, str]:
    """The caller's mapping, and why it has a single id when it does ("" otherwise)."""
    uid, gid = os.geteuid(), os.getegid()
    names = {str(uid)}
    with contextlib.suppress(KeyError):
        names.add(pwd.getpwuid(uid).pw_name)
    single = IdMap(uid, gid)
    missing = [tool for tool in ("newuidmap", "newgidmap") if shutil.which(tool) is None]
    if missing:
        return single, f"{' and '.join(missing)} missing (Debian package uidmap)"
    sub_uid = _subid_start("/etc/subuid", names)
    sub_gid = _subid_start("/etc/subgid", names)
    if sub_uid is None or sub_gid is None:
        which = "/etc/subuid" if sub_uid is None else "/etc/subgid"
        return single, f"no range of 65535 ids for {max(names, key=len)} in {which}"
    return IdMap(uid, gid, sub_uid, sub_gid), ""


def runtime_base(*, create: bool = True) -> Path:
    """This user's directory for runtime state: ``$XDG_RUNTIME_DIR/sandlot``, else
    ``/tmp/sandlot-<uid>/sandlot`` (``/tmp/sandlot-<uid>`` made private when ``create``, and
    refused if someone else made it first).

    Raises:
        BackendUnavailable: the directory exists and is not this user's private one.
    """
    uid = os.geteuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        with contextlib.suppress(OSError):
            st = Path(xdg).stat()
            if st.st_uid == uid and stat.S_ISDIR(st.st_mode):
                return Path(xdg) / "sandlot"
    # Checked below: ours, private, not a symlink (anyone may create a name in /tmp first).
    base = Path(f"/tmp/sandlot-{uid}")
    if create:
        with contextlib.suppress(FileExistsError):
            base.mkdir(mode=0o700)
    try:
        st = base.lstat()
    except FileNotFoundError:
        return base / "sandlot"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) & 0o077:
        msg = (
            f"{base} is not a private directory of uid {uid}; set XDG_RUNTIME_DIR to a "
            "directory of yours"
        )
        raise BackendUnavailable(msg)
    return base / "sandlot"


_compiled: list[Path] = []


def compile_helper(directory: Path) -> Path | None:
    """Compile :mod:`.userns_helper` into ``directory`` for this interpreter (once; a script
    run as ``__main__`` is otherwise compiled on every sandbox start, about 5 ms); the
    ``.pyc``, or None when that failed (the source then runs, only slower)."""
    import hashlib
    import py_compile

    digest = hashlib.sha256(HELPER.read_bytes()).hexdigest()[:16]
    target = directory / f"userns-helper-{digest}.{sys.implementation.cache_tag}.pyc"
    if not target.exists():
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        try:
            py_compile.compile(str(HELPER), cfile=str(tmp), doraise=True)
            tmp.replace(target)
        except (OSError, py_compile.PyCompileError):
            with contextlib.suppress(OSError):
                tmp.unlink()
            return None
    for old in directory.glob("userns-helper-*.pyc"):
        if old != target:
            with contextlib.suppress(OSError):
                old.unlink()  # a running helper has its code loaded already
    _compiled[:] = [target]
    return target


def _helper_script() -> str:
    # The compiled copy lives in a runtime directory that may be removed when idle.
    if _compiled and _compiled[0].exists():
        return str(_compiled[0])
    return str(HELPER)


def _map_arg(ranges: Sequence[tuple[int, int, int]]) -> str:
    return " ".join(f"{a} {b} {c}" for a, b, c in ranges)


def helper_argv(idmap: IdMap, **options: str | Sequence[str]) -> list[str]:
    """The command line that runs :mod:`.userns_helper` for ``idmap`` with ``options``
    (``overlay``, ``lower`` (a list), ``upper``, ``work``, ``workdir``, ``op``, ``args``...);
    append ``--`` and a command to run one."""
    argv = [
        sys.executable,
        "-I",
        "-S",
        _helper_script(),
        "--uid-map",
        _map_arg(idmap.uid_ranges()),
        "--gid-map",
        _map_arg(idmap.gid_ranges()),
        "--newidmap",
        "1" if idmap.full else "0",
    ]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        for item in [value] if isinstance(value, str) else value:
            argv += [flag, item]
    return argv


def run_op(idmap: IdMap, op: str, args: Mapping[str, object]) -> dict[str, object]:
    """Run a file operation of :mod:`.userns_helper` as root of a user namespace with
    ``idmap``; its JSON answer.

    Raises:
        BackendError: the helper failed, or the operation reported an error.
    """
    argv = helper_argv(
        idmap,
        op=op,
        args=json.dumps(dict(args)),
        layers_py=str(_LAYERS_PY),
        errors_py=str(_ERRORS_PY),
    )
    try:
        proc = subprocess.run(argv, capture_output=True, check=False, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        msg = f"cannot run the user-namespace helper: {e}"
        raise BackendError(msg) from e
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[-2000:]
        msg = f"user-namespace helper ({op}) failed: {err or f'exit {proc.returncode}'}"
        raise BackendError(msg)
    try:
        doc = json.loads(proc.stdout)
    except ValueError as e:
        msg = f"user-namespace helper ({op}): unreadable answer"
        raise BackendError(msg) from e
    if not isinstance(doc, dict):
        msg = f"user-namespace helper ({op}): unexpected answer"
        raise BackendError(msg)
    if "error" in doc:
        raise BackendError(str(doc["error"]))
    return doc


def remove_trees(idmap: IdMap, paths: Sequence[Path]) -> None:
    """Remove directory trees that a rootless sandbox wrote into.

    What belongs to the caller goes directly (directories it made unreadable are opened up
    first); whatever is left (files of the caller's subordinate ids) is removed from inside a
    user namespace, where the caller is root over those ids.

    Raises:
        BackendError: something could not be removed.
    """

    def opened_up(func: object, path: str, exc: object) -> None:
        # Overlay's work directory and whatever the sandbox chmodded to 000: ours to open.
        target = Path(path)
        with contextlib.suppress(OSError):
            for p in (target.parent, target):
                st = p.lstat()
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                    p.chmod(stat.S_IMODE(st.st_mode) | 0o700)
        with contextlib.suppress(OSError):
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink()

    left = []
    for path in paths:
        if not os.path.lexists(path):
            continue
        with contextlib.suppress(OSError):
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=opened_up)
            else:
                shutil.rmtree(path, onerror=opened_up)
        if os.path.lexists(path):
            left.append(path)
    if not left:
        return
    doc = run_op(idmap, "remove", {"paths": [str(p) for p in left]})
    still = doc.get("left")
    if isinstance(still, list) and still:
        msg = f"cannot remove {', '.join(str(s) for s in still)}"
        raise BackendError(msg)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError), open(task / "children") as f:
                out.extend(int(x) for x in f.read().split())
    return out


def sandbox_pids(init: int) -> list[int]:
    """Host pids of the sandbox whose init is ``init``: its descendants (an orphan inside is
    re-parented to that init, never outside its pid namespace)."""
    seen = {init} if Path(f"/proc/{init}").exists() else set()
    todo = list(seen)
    while todo:
        for child in _children(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return sorted(seen)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split(" ", 1)[0]


def _stop_pending(pid: int) -> bool:
    """Whether ``SIGSTOP`` is pending for the process (its own or its thread group's)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    bit = 1 << (signal.SIGSTOP - 1)
    return any(int(fields.get(name, "0").strip() or "0", 16) & bit for name in ("ShdPnd", "SigPnd"))


def freeze(init: int, *, timeout: float = 5.0) -> list[int]:
    """Stop every process of a sandbox (``SIGSTOP``) until a pass finds none running; the
    pids this stopped, for :func:`thaw`.

    A fork racing the signal is restarted by the kernel after the stop, so once a whole pass
    sees every process stopped, none can run until thawed. A process with ``SIGSTOP`` pending
    counts as stopped: the parent of a ``vfork`` sits in ``D`` until its child execs (which
    a stopped child never does), and it cannot run user code before the pending stop.

    Raises:
        BackendError: processes kept appearing for ``timeout`` seconds.
    """
    stopped: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        running = [
            p
            for p in sandbox_pids(init)
            if _state(p) not in ("T", "t", "Z", "X", None) and not _stop_pending(p)
        ]
        if not running:
            return sorted(stopped)
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.add(pid)
        if time.monotonic() > deadline:
            thaw(sorted(stopped))
            msg = "the sandbox's processes could not all be stopped for a snapshot"
            raise BackendError(msg)
        time.sleep(0.001)


def thaw(pids: Sequence[int]) -> None:
    """Continue the processes :func:`freeze` stopped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _tool(name: str) -> str | None:
    # A normal user's PATH often lacks the sbin directories (where nft lives).
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def slirp_problem() -> str | None:
    """Why ``allow-all`` cannot be offered without root here (None: it can)."""
    if _tool("slirp4netns") is None:
        return "slirp4netns is not installed (Debian package slirp4netns)"
    # slirp4netns opens the TUN device from inside the sandbox's user namespace, with the
    # caller's permissions on the host's device node (Debian's udev makes it 0666).
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "/dev/net/tun is not usable by this user (as root: chmod 0666 /dev/net/tun)"
    for tool, package in (("nft", "nftables"), ("nsenter", "util-linux")):
        if _tool(tool) is None:
            return (
                f"{tool} is not installed (Debian package {package}); without it a sandbox's "
                "outbound network could reach the host's own addresses and link-local ones"
            )
    return None


def _host_addresses() -> list[str]:
    """The host's own IPv4 addresses (``LOCAL`` entries of its routing trie)."""
    found: list[str] = []
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
    except OSError:
        return found
    last = ""
    for line in lines:
        text = line.strip()
        if text.startswith("|-- "):
            last = text[4:]
        elif text == "/32 host LOCAL" and last and last not in found:
            found.append(last)
    return found


# What rootful ``allow-all`` also refuses (see docs/network.md), for a sandbox whose way out is
# slirp4netns running as the caller on the host: its gateway (the host's loopback, refused by
# slirp4netns too), the host's own addresses, link-local (cloud metadata), multicast and
# broadcast. The resolver slirp4netns offers stays reachable. Loaded in one transaction that
# first drops any fence of an earlier attachment (a sandbox switched back to allow-all), so the
# rules never double and never lapse.
_FENCE = """\
table inet sandlot {{}}
delete table inet sandlot
table inet sandlot {{
  chain out {{
    type filter hook output priority 0; policy accept;
    oifname "lo" accept
    ip daddr {dns} meta l4proto {{ tcp, udp }} th dport 53 accept
    ip daddr {{ {blocked} }} reject
    meta nfproto ipv6 oifname != "lo" reject
  }}
}}
"""


def fence_slirp(init: int) -> None:
    """Refuse from inside the sandbox's network namespace what rootful ``allow-all`` refuses.

    The rules live in the sandbox's own namespace, where its root lacks ``CAP_NET_ADMIN`` (not
    in its bounding set) and cannot get it (its seccomp profile forbids new user namespaces),
    so it cannot change them; the caller enters the namespace as its owner.

    Raises:
        BackendError: the rules could not be loaded.
    """
    # slirp4netns connects from the host, so whatever the host routes to is in reach: the
    # address pool of rootful sandboxes and NAT microVMs on this host is refused too.
    blocked = [
        "0.0.0.0/8",
        "10.0.2.0/24",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/3",
        configured_pool(),
        *(a for a in _host_addresses() if not a.startswith("127.")),
    ]
    rules = _FENCE.format(dns=SLIRP_DNS, blocked=", ".join(blocked))
    argv = [
        _tool("nsenter") or "nsenter",
        f"--target={init}",
        "--user",
        "--net",
        "--preserve-credentials",
        _tool("nft") or "nft",
        "-f",
        "-",
    ]
    try:
        proc = subprocess.run(argv, input=rules.encode(), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        msg = f"cannot fence the sandbox's network: {e}"
        raise BackendError(msg) from e
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[-1000:]
        msg = f"cannot fence the sandbox's network: {err or f'exit {proc.returncode}'}"
        raise BackendError(msg)


def start_slirp(init: int, log: Path, *, timeout: float = 10.0) -> int:
    """Give the sandbox whose init is ``init`` outbound network through ``slirp4netns``; its
    pid (a child of this process, in a session of its own).

    The sandbox gets ``tap0`` (10.0.2.100/24, gateway 10.0.2.2, resolver :data:`SLIRP_DNS`);
    ``--disable-host-loopback`` keeps the host's loopback unreachable through the gateway.

    Raises:
        BackendUnavailable: slirp4netns is not installed or cannot open the TUN device.
        BackendError: it did not configure the namespace in ``timeout`` seconds.
    """
    exe = _tool("slirp4netns")
    problem = slirp_problem()
    if exe is None or problem is not None:
        msg = f"allow-all without root needs slirp4netns: {problem}"
        raise BackendUnavailable(msg)
    ready_r, ready_w = os.pipe()
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        argv = [
            exe,
            "--configure",
            "--mtu=65520",
            "--disable-host-loopback",
            "--enable-sandbox",
            "--enable-seccomp",
            "--ready-fd=3",
            str(init),
            "tap0",
        ]
        pid = os.posix_spawn(
            exe,
            argv,
            dict(os.environ),
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
                (os.POSIX_SPAWN_DUP2, ready_w, 3),
            ],
            setsid=True,
        )
    finally:
        os.close(ready_w)
        os.close(log_fd)
    try:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([ready_r], [], [], max(0.0, left))
            if readable:
                if os.read(ready_r, 1) == b"1":
                    return pid
                break
            if left <= 0:
                break
    finally:
        os.close(ready_r)
    stop_slirp(pid, None)
    try:
        detail = log.read_bytes()[-1000:].decode(errors="replace").strip()
    except OSError:
        detail = ""
    msg = f"slirp4netns did not set up the sandbox's network: {detail or 'no output'}"
    raise BackendError(msg)


def stop_slirp(pid: int, start_time: int | None) -> None:
    """End a sandbox's slirp4netns (if it is the process that started at ``start_time``)."""
    if process_alive(pid, start_time):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reap(pid, start_time, timeout=1.0)
