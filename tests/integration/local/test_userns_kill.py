"""A process killed (``kill -9``) while it makes a sandbox's user namespace leaves nothing behind.

The namespace is made by cloning a child into it (``mounts._userns_by_clone``). That child
shares the parent's memory and has a copy of its fds; a child that waited to be killed would
outlive a killed server and keep its listening socket, so the restarted server could not bind
its port (the crash campaign in ``tests/crash`` found one). Here a real process is killed at
the worst moment: after the clone, before the namespace's maps are written.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Holds a listening socket (as the server does), then makes a namespace and stops for good
# right after the clone, when it is about to write the child's uid map.
_VICTIM = textwrap.dedent(
    """
    import builtins, socket, sys, time
    from sandlot.backends.local import mounts

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    real_open = builtins.open

    def stop_at_uid_map(path, *args, **kwargs):
        if str(path).endswith("/uid_map"):
            child = str(path).split("/")[2]
            print(listener.getsockname()[1], child, flush=True)
            time.sleep(600)
        return real_open(path, *args, **kwargs)

    builtins.open = stop_at_uid_map
    if mounts._userns_by_clone(1_900_000_000, 65536) is None:
        print("unsupported", flush=True)
    """
)


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines())}


@pytest.mark.timeout(60)
def test_killed_while_making_a_user_namespace_leaves_no_process_holding_its_fds() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _VICTIM], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    ) as victim:
        try:
            assert victim.stdout is not None
            line = victim.stdout.readline().decode().split()
            if line == ["unsupported"]:
                pytest.skip("namespaces are made by clone only on x86_64")
            port, child = int(line[0]), int(line[1])
            assert _status(child).get("PPid") == str(victim.pid), "not the cloned child"
        finally:
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=30)
    # Orphaned, the child is reparented and reaped, or left a zombie (which holds no fds)
    # where init does not reap: either way nothing may still run with the dead process's fds.
    deadline = time.monotonic() + 10
    while (state := _status(child).get("State", "gone")) != "gone" and not state.startswith("Z"):
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"the cloned child {child} outlived its killed parent ({state})")
        time.sleep(0.05)
    # What a restarted server needs: its port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
