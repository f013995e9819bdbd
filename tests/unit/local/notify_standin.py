"""Stand in for crun in strict mode: load an exec-notify filter, hand its fd over, run a program.

Usage: ``python notify_standin.py LISTENER_PATH PROGRAM [ARG...]``. Loads a seccomp filter whose
``execve``/``execveat`` rules are ``SCMP_ACT_NOTIFY`` (libseccomp, through ctypes), connects to
the unix socket at LISTENER_PATH and sends the notify fd with ``SCM_RIGHTS`` and a JSON state,
as crun does with ``linux.seccomp.listenerPath``, then replaces itself with PROGRAM (whose exec
is the first one decided). With LISTENER_PATH ``-`` it loads no filter (the baseline). Used by
the notifier's tests and by ``bench/strict.py``.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_NOTIFY = 0x7FC00000


def load_filter() -> int:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_notify_fd.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    for name in (b"execve", b"execveat"):
        nr = lib.seccomp_syscall_resolve_name(name)
        if lib.seccomp_rule_add(ctx, SCMP_ACT_NOTIFY, nr, 0) != 0:
            msg = "seccomp_rule_add failed"
            raise OSError(msg)
    if lib.seccomp_load(ctx) != 0:
        msg = "seccomp_load failed"
        raise OSError(msg)
    fd = lib.seccomp_notify_fd(ctx)
    if fd < 0:
        msg = "no notify fd"
        raise OSError(msg)
    return int(fd)


def main() -> None:
    listener, argv = sys.argv[1], sys.argv[2:]
    if listener != "-":
        fd = load_filter()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(listener)
            state = {
                "ociVersion": "1.0.2",
                "id": "standin",
                "pid": os.getpid(),
                "fds": ["seccompFd"],
            }
            socket.send_fds(conn, [json.dumps(state).encode()], [fd])
        os.close(fd)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
