"""Noisy neighbour: tenant B floods a background process's output to ten followers.

B starts ``yes flood`` through the processes API and opens ten ``follow=true`` streams of its
output; half read as fast as they can, half never read a byte. Tenant A's ``echo hi`` and list
must not notice (before the fix every follower had its own reader in the agent and the server
ran at ~96% CPU: A's exec took seconds).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
from tests.security.noisy import NoisyServer, Victim, assert_unharmed


def _follow(server: NoisyServer, sid: str, pid: str, stop: threading.Event, *, read: bool) -> int:
    """Follow the output until ``stop``; a reader reconnects from where it was whenever its
    stream ends (it is dropped when it falls behind). How many output events it read."""
    url = f"/v1/sandboxes/{sid}/processes/{pid}/output"
    offset, outputs = 0, 0
    with server.client(server.key_b, timeout=120) as b:
        while not stop.is_set():
            params = {"follow": "true", "offset": str(offset)}
            with b.stream("GET", url, params=params) as r:
                assert r.status_code == 200
                if not read:
                    stop.wait()
                    break
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        offset, outputs = int(line[4:]) + 1, outputs + 1
                    if stop.is_set():
                        break
    return outputs


def test_followers_of_a_flooding_process_do_not_slow_another_tenant(tmp_path: Path) -> None:
    with NoisyServer(tmp_path) as server:
        victim = Victim(server, rounds=20)
        base = victim.measure()
        with server.client(server.key_b) as b:
            sid = b.post("/v1/sandboxes", json={"spec": {"network": "deny-all"}}).json()["id"]
            started = b.post(f"/v1/sandboxes/{sid}/processes", json={"command": "yes flood"})
            assert started.status_code == 201, started.text
            pid = started.json()["id"]
            stop = threading.Event()
            errors: list[BaseException] = []
            read: list[int] = []

            def follower(reads: bool) -> None:
                try:
                    read.append(_follow(server, sid, pid, stop, read=reads))
                except (httpx.HTTPError, AssertionError) as e:
                    errors.append(e)

            threads = [
                threading.Thread(target=follower, args=(i % 2 == 0,), daemon=True)
                for i in range(10)
            ]
            for t in threads:
                t.start()
            try:
                stop.wait(1.0)  # let the followers attach and the flood build
                loaded = victim.measure()
            finally:
                stop.set()
                b.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", json={"signal": 9})
                b.delete(f"/v1/sandboxes/{sid}")
                for t in threads:
                    t.join(timeout=60)
        victim.close()
        assert not errors, errors
        assert sum(read) > 0  # the readers were served: the flood was real
        assert_unharmed(base, loaded)


def test_a_follower_that_stalls_is_dropped_and_resumes_where_it_was(tmp_path: Path) -> None:
    with NoisyServer(tmp_path) as server, server.client(server.key_b) as b:
        sid = b.post("/v1/sandboxes", json={"spec": {"network": "deny-all"}}).json()["id"]
        pid = b.post(f"/v1/sandboxes/{sid}/processes", json={"command": "yes flood"}).json()["id"]
        url = f"/v1/sandboxes/{sid}/processes/{pid}/output"
        stop = threading.Event()
        reader = threading.Thread(
            target=_follow, args=(server, sid, pid, stop), kwargs={"read": True}
        )
        reader.start()
        try:
            with b.stream("GET", url, params={"follow": "true"}) as stalled:
                stop.wait(3)  # the reader keeps the output coming; this one reads nothing
                last, name, dropped = -1, "", None
                for n, line in enumerate(stalled.iter_lines()):
                    if line.startswith("id: "):
                        last = int(line[4:])
                    if n > 5000:
                        break  # far more than the socket buffers held: it was never dropped
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: ") and name == "dropped":
                        dropped = json.loads(line[6:])
            # Its stream ended saying where to resume, after the last chunk it got.
            assert dropped is not None
            assert dropped["next_offset"] == last + 1
            params = {"follow": "false", "offset": str(dropped["next_offset"])}
            with b.stream("GET", url, params=params) as resumed:
                ids = [int(x[4:]) for x in resumed.iter_lines() if x.startswith("id: ")]
            assert ids
            assert ids[0] >= dropped["next_offset"]
        finally:
            stop.set()
            reader.join(timeout=60)
            b.post(f"/v1/sandboxes/{sid}/processes/{pid}/signal", json={"signal": 9})
            b.delete(f"/v1/sandboxes/{sid}")
