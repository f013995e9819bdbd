"""Who is doing the work: a process identity that survives PID reuse, and a liveness check.

A lease names its holder, and an exec run names the process streaming its output. After a crash
the survivor must tell "that process is gone" from "that PID now belongs to someone else", so
the identity carries the process start time (field 22 of ``/proc/<pid>/stat``, in clock ticks
since boot) beside the host name and PID. This module imports only the standard library.
"""

from __future__ import annotations

import functools
import os
import socket

__all__ = ["owner_alive", "process_owner"]


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ")".
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


@functools.cache
def process_owner() -> str:
    """This process's identity: ``"<host>:<pid>:<start ticks>"``."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid) or '?'}"


def owner_alive(owner: str) -> bool:
    """Whether the process ``owner`` names may still be running.

    Only a process on this host can be proven dead (its PID is gone, or belongs to a process
    that started at another time). An owner on another host, or in a form this function does
    not know, counts as alive: declaring a live process dead could run its work twice, while
    the cost of the opposite error is only a run reported late.

    Args:
        owner: A string made by :func:`process_owner` (in this or another process).
    """
    host, _, rest = owner.partition(":")
    pid_text, _, ticks = rest.partition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return True
    current = _start_ticks(int(pid_text))
    if current is None:
        return False
    return ticks in ("", "?") or current == ticks


# A forked child is another process: it must not inherit its parent's identity.
os.register_at_fork(after_in_child=process_owner.cache_clear)
