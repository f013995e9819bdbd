"""Enter a rootless sandbox's user namespace, then run a program or a layer operation there.

Run as a script (``python -I -S userns_helper.py OPTIONS -- ARGV``) by the ``local`` backend when
it is not root; it imports only the standard library, so it starts in a few milliseconds. It
makes a user namespace whose root is the caller and, when the caller has a subordinate id range
(``/etc/subuid``, ``/etc/subgid``) and ``newuidmap``/``newgidmap`` are installed, whose ids
``1..65535`` are that range; otherwise the caller is the only id in it. Then, in order:

- ``--overlay TARGET``: a private mount namespace owned by that user namespace, with the
  sandbox's root overlay (``--lower`` top first, ``--upper``, ``--work``) mounted at ``TARGET``
  (overlayfs may be mounted in a user namespace since Linux 5.11). The mount exists only in this
  namespace and the sandbox's copy of it, so nothing is left on the host when the sandbox ends.
  On a cgroup v1/v2 hybrid host the v2 hierarchy is covered there too (:func:`hide_hybrid_v2`);
- ``--workdir PATH``: make the sandbox's working directory inside that root, never following a
  symlink the sandbox may have planted;
- ``--op NAME``: a :mod:`sandlot.backends.local.layers` operation on files the sandbox owns
  (whose host owners are the caller and its subordinate ids, so only a process holding
  capabilities in such a namespace may read or remove them all), answered as JSON on stdout;
- otherwise ``execv`` of ``ARGV`` (the runtime, ``tar``, ...), which inherits every open fd the
  caller passed, and root with full capabilities over the namespace's ids.

Exit status 125 with a message on stderr means the namespace could not be set up.
"""

# A stdlib-only script run with -I -S on every sandbox start: plain os calls on string paths
# (no pathlib objects), and try/except instead of contextlib (an import it need not pay for).
# ruff: noqa: PTH102, PTH110, PTH112, SIM105

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys

# Every import counts here (this runs on each sandbox start): typing, json and contextlib
# would add about 15 ms, so the first is only for type checkers and the others are avoided.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import NoReturn

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
_SYS_MOVE_MOUNT = 429
_FSCONFIG_SET_FLAG = 0
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_FDCWD = -100
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class HelperError(Exception):
    """The namespace or the mount could not be made (exit status 125)."""


def _fail(what: str) -> NoReturn:
    """Raise :class:`HelperError` for the failed call ``what`` with the C errno's text."""
    msg = f"{what}: {os.strerror(ctypes.get_errno())}"
    raise HelperError(msg)


def _parse(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return opts, argv[i + 1 :]
        if not arg.startswith("--") or i + 1 >= len(argv):
            msg = f"bad argument {arg!r}"
            raise HelperError(msg)
        opts.setdefault(arg[2:], []).append(argv[i + 1])
        i += 2
    return opts, []


def _one(opts: dict[str, list[str]], key: str) -> str | None:
    values = opts.get(key)
    return values[-1] if values else None


def _spawn_wait(argv: list[str]) -> int:
    pid = os.posix_spawnp(argv[0], argv, dict(os.environ))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def enter_userns(uid_map: str, gid_map: str, *, newidmap: bool, mount_ns: bool) -> None:
    """Move this (single-threaded) process into a new user namespace with the given maps.

    Maps are ``inside outside count`` triples separated by spaces. With ``newidmap`` they are
    written by ``newuidmap``/``newgidmap`` (setuid helpers that check ``/etc/subuid``) from a
    child left in the original namespace; without it this process writes a map of its own ids.
    """
    flags = _CLONE_NEWUSER | (_CLONE_NEWNS if mount_ns else 0)
    if not newidmap:
        if _libc.unshare(flags) != 0:
            _fail("unshare(CLONE_NEWUSER)")
        # An unprivileged process may map only its own ids, and only after giving up
        # setgroups (else it could drop a group that denies it access).
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(_map_lines(text))
        return
    go_r, go_w = os.pipe()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        # Stays behind in the original namespace: newuidmap must be run from there.
        rc = 1
        try:
            os.close(go_w)
            if os.read(go_r, 1) == b"1":
                rc = _spawn_wait(["newuidmap", str(parent), *uid_map.split()])
                if rc == 0:
                    rc = _spawn_wait(["newgidmap", str(parent), *gid_map.split()])
        except BaseException as e:  # the child must never return into the caller's code
            sys.stderr.write(f"sandlot userns helper: {e}\n")
        finally:
            os._exit(rc if 0 <= rc < 125 else 1)
    os.close(go_r)
    ok = _libc.unshare(flags) == 0
    err = ctypes.get_errno()
    os.write(go_w, b"1" if ok else b"0")
    os.close(go_w)
    _, status = os.waitpid(child, 0)
    if not ok:
        msg = f"unshare(CLONE_NEWUSER): {os.strerror(err)}"
        raise HelperError(msg)
    if os.waitstatus_to_exitcode(status) != 0:
        msg = "newuidmap/newgidmap refused the subordinate id ranges"
        raise HelperError(msg)
    # Supplementary groups of the caller are not mapped (they would show as nogroup).
    try:
        os.setgroups([])
    except OSError:
        pass


def _map_lines(text: str) -> str:
    parts = text.split()
    return "".join(f"{' '.join(parts[i : i + 3])}\n" for i in range(0, len(parts), 3))


def _fsconfig_string(fs: int, key: str, value: str) -> int:
    return int(
        _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, key.encode(), value.encode(), 0)
    )


def mount_overlay(target: str, lowers: list[str], upper: str, work: str) -> None:
    """Mount the sandbox's root overlay at ``target`` in this private mount namespace."""
    if _libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        _fail("make / private")
    fs = int(_libc.syscall(_SYS_FSOPEN, b"overlay", 1))
    if fs < 0:
        _fail("fsopen(overlay)")
    try:
        for lower in lowers:
            # lowerdir+ (Linux 6.8) takes one path per call: no escaping, no length limit.
            if _fsconfig_string(fs, "lowerdir+", lower) != 0:
                if ctypes.get_errno() != errno.EINVAL or lower != lowers[0]:
                    _fail(f"overlay lower layer {lower}")
                _classic_overlay(target, lowers, upper, work)
                return
        for key, value in (("upperdir", upper), ("workdir", work)):
            if _fsconfig_string(fs, key, value) != 0:
                _fail(f"overlay {key} {value}")
        # In a user namespace overlayfs keeps its markers in user.overlay.* xattrs; trusted.*
        # ones need capabilities on the host.
        if _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_FLAG, b"userxattr", None, 0) != 0:
            _fail("overlay userxattr")
        for key, value in (("index", "off"), ("xino", "off")):
            _fsconfig_string(fs, key, value)
        if _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0) != 0:
            _fail("overlay create")
        mfd = int(_libc.syscall(_SYS_FSMOUNT, fs, 1, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV))
        if mfd < 0:
            _fail("fsmount(overlay)")
        try:
            if (
                _libc.syscall(
                    _SYS_MOVE_MOUNT,
                    mfd,
                    b"",
                    _AT_FDCWD,
                    target.encode(),
                    _MOVE_MOUNT_F_EMPTY_PATH,
                )
                != 0
            ):
                _fail(f"move_mount({target})")
        finally:
            os.close(mfd)
    finally:
        os.close(fs)


def _classic_overlay(target: str, lowers: list[str], upper: str, work: str) -> None:
    for path in (*lowers, upper, work):
        if any(c in path for c in ":,\\"):
            msg = f"this kernel cannot mount an overlay layer at {path!r}"
            raise HelperError(msg)
    opts = (
        f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work},userxattr,index=off,xino=off"
    )
    flags = _MS_NOSUID | _MS_NODEV
    if _libc.mount(b"overlay", target.encode(), b"overlay", flags, opts.encode()) != 0:
        _fail("mount overlay")


_V2_IN_HYBRID = "/sys/fs/cgroup/unified"


def hide_hybrid_v2() -> None:
    """On a cgroup v1/v2 hybrid host, cover the v2 hierarchy with an empty tmpfs in this mount
    namespace, so that the runtime sees a v1 host.

    crun refuses every container on a hybrid host whose v2 hierarchy holds a controller
    ("cgroups in hybrid mode not supported"), even with its cgroup manager disabled; as root
    the backend moves hugetlb (the one left there) to v1, which a normal user cannot. Rootless
    sandboxes use no cgroup, and their own ``/sys`` is a fresh sysfs, so nothing else sees it.
    """
    if not os.path.isdir(_V2_IN_HYBRID) or os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return  # not hybrid: a pure v1 or a unified host
    flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if _libc.mount(b"tmpfs", _V2_IN_HYBRID.encode(), b"tmpfs", flags, b"size=4k,mode=555") == 0:
        return
    err = ctypes.get_errno()
    try:
        with open(f"{_V2_IN_HYBRID}/cgroup.controllers") as f:
            controllers = f.read().strip()
    except OSError:
        controllers = ""
    if controllers:
        # Only then does crun care: say what is wrong instead of crun's riddle.
        msg = (
            f"cannot hide the cgroup v2 hierarchy ({os.strerror(err)}), which holds "
            f"{controllers} on this hybrid host; crun refuses to run there (as root: "
            "mkdir -p /sys/fs/cgroup/hugetlb && mount -t cgroup -o hugetlb cgroup "
            "/sys/fs/cgroup/hugetlb)"
        )
        raise HelperError(msg)


def ensure_workdir(root: str, workdir: str) -> None:
    """``mkdir -p`` of ``workdir`` under ``root``, stopping at a symlink or a non-directory
    (the sandbox's agent then reports the bad working directory itself)."""
    path = root
    for part in [p for p in workdir.split("/") if p and p != "."]:
        if part == "..":
            return
        path = f"{path}/{part}"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.mkdir(path, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return


def _load_layers(layers_py: str, errors_py: str) -> ModuleType:
    """Import the layers module by path, without the sandlot package (and its dependencies)."""
    import importlib.util

    for name, path in (("sandlot.errors", errors_py), ("sandlot_layers", layers_py)):
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            msg = f"cannot load {path}"
            raise HelperError(msg)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules["sandlot_layers"]


def run_op(name: str, args: dict[str, object], layers_py: str, errors_py: str) -> object:
    """One file operation inside the namespace; its JSON-able result (``{"error": ...}`` when
    the operation itself failed)."""
    from pathlib import Path

    if name == "remove":
        import shutil

        paths = [str(p) for p in _list(args.get("paths"))]
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        return {"left": [p for p in paths if os.path.lexists(p)]}
    layers = _load_layers(layers_py, errors_py)
    try:
        if name == "describe":
            found = layers.describe_upper(
                Path(str(args["upper"])), uid_base=0, uid_size=1 << 32, xattr_prefix="user"
            )
            return {"digest": found.digest, "entries": found.entries}
        if name == "capture":
            digest, size = layers.capture(
                Path(str(args["upper"])),
                Path(str(args["dest"])),
                uid_base=0,
                uid_size=1 << 32,
                base=_list(args.get("base")),
                spec=args.get("spec") or {},
                sandbox_id=str(args["sandbox_id"]),
                xattr_prefix="user",
            )
            return {"digest": digest, "size": size}
        if name == "verify":
            digest = args.get("digest")
            layers.verify(
                Path(str(args["snapshot"])),
                digest if isinstance(digest, str) else None,
                xattr_prefix="user",
            )
            return {}
    except Exception as e:  # reported to the backend, which raises its own error
        return {"error": str(getattr(e, "message", e))}
    msg = f"unknown operation {name!r}"
    raise HelperError(msg)


def _list(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


_PR_SET_CHILD_SUBREAPER = 36


def _exec(argv: list[str], exe_fd: int | None) -> NoReturn:
    """Execute ``argv``: from the inherited descriptor ``exe_fd`` when given (the caller's
    sealed copy of the binary, which a process in another user namespace may not open through
    the caller's ``/proc``), else ``argv[0]`` from ``PATH``."""
    if exe_fd is not None:
        # Closed by the exec itself: the program never sees it.
        os.set_inheritable(exe_fd, False)
        try:
            os.execv(f"/proc/self/fd/{exe_fd}", argv)
        except OSError:
            pass
    os.execvp(argv[0], argv)


def _run_reaping(argv: list[str], exe_fd: int | None) -> int:
    """Run ``argv`` as a child and return its exit status, after collecting whatever it
    left exited behind (a runtime's intermediate processes), so that nothing but live
    processes (the container's init) is handed on to the caller when this process ends."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = os.fork()
    if child == 0:
        try:
            _exec(argv, exe_fd)
        finally:
            os._exit(127)
    _, status = os.waitpid(child, 0)
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    """Entry point: see the module docstring."""
    try:
        opts, rest = _parse(argv)
        target = _one(opts, "overlay")
        enter_userns(
            _one(opts, "uid-map") or "",
            _one(opts, "gid-map") or "",
            newidmap=_one(opts, "newidmap") == "1",
            mount_ns=target is not None,
        )
        if target is not None:
            mount_overlay(
                target, opts.get("lower", []), _one(opts, "upper") or "", _one(opts, "work") or ""
            )
            hide_hybrid_v2()
            workdir = _one(opts, "workdir")
            if workdir:
                ensure_workdir(target, workdir)
        op = _one(opts, "op")
        if op is not None:
            import json

            result = run_op(
                op,
                json.loads(_one(opts, "args") or "{}"),
                _one(opts, "layers-py") or "",
                _one(opts, "errors-py") or "",
            )
            sys.stdout.write(json.dumps(result))
            return 0
        if not rest:
            msg = "nothing to run"
            raise HelperError(msg)
        exe_fd = _one(opts, "exe-fd")
        if _one(opts, "reap") == "1":
            return _run_reaping(rest, int(exe_fd) if exe_fd else None)
        _exec(rest, int(exe_fd) if exe_fd else None)
    except (HelperError, OSError) as e:
        sys.stderr.write(f"sandlot userns helper: {e}\n")
        return 125
    return 125


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
