"""What `sandlot serve` keeps of exec output for reconnects: a bounded amount, for a bounded time.

Before: every streamed exec's collected output went into the database twice (its chunks, up to
16 MiB, and again whole in its result), so 40 execs of 16 MiB made a 1.3 GB ``sandlot.db``; and
``--output-retention`` never reached the output log, so output stayed readable for the default
five minutes.
"""

from __future__ import annotations

import json
import time
from base64 import b64decode
from pathlib import Path

import httpx
from tests.security.noisy import NoisyServer

MIB = 1 << 20


def _events(response: httpx.Response) -> list[tuple[str, str | None, object]]:
    """(event, id, data) of a whole ``text/event-stream`` response."""
    out: list[tuple[str, str | None, object]] = []
    name, data, event_id = "", "", None
    for line in response.iter_lines():
        if line == "":
            if data:
                out.append((name, event_id, json.loads(data)))
            name, data, event_id = "", "", None
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line.startswith("id: "):
            event_id = line[4:]
    return out


def _streamed_exec(
    http: httpx.Client, sid: str, command: str
) -> tuple[str, int, dict[str, object]]:
    """Run ``command`` streamed; (exec id, output bytes streamed, result)."""
    with http.stream("POST", f"/v1/sandboxes/{sid}/execs", json={"command": command}) as r:
        assert r.status_code == 200, r.read()
        events = _events(r)
    exec_id = ""
    streamed = 0
    result: dict[str, object] = {}
    for name, _, data in events:
        assert isinstance(data, dict)
        if name == "started":
            exec_id = str(data["exec_id"])
        elif name == "output":
            streamed += len(b64decode(data["data"]))
        elif name == "result":
            result = data
    assert result, events[-1:]
    return exec_id, streamed, result


def _db_bytes(home: Path) -> int:
    return sum(p.stat().st_size for p in home.glob("sandlot.db*"))


def test_large_outputs_do_not_grow_the_database_past_the_cap(tmp_path: Path) -> None:
    runs, size = 6, 8 * MIB  # each twice the default 4 MiB kept per command
    with NoisyServer(tmp_path) as server, server.client(server.key_a) as http:
        sid = http.post("/v1/sandboxes", json={"spec": {"network": "deny-all"}}).json()["id"]
        before = _db_bytes(tmp_path)
        for _ in range(runs):
            _, streamed, result = _streamed_exec(
                http, sid, f"head -c {size} /dev/zero | tr '\\0' x"
            )
            # The client that runs the command still gets all of it, live and in its result.
            assert streamed == size
            assert result["stdout"] == "x" * size
        grown = _db_bytes(tmp_path) - before
        http.delete(f"/v1/sandboxes/{sid}")
    # What is kept, plus SQLite's slack (page headers, free pages, an uncheckpointed WAL);
    # before the cap every run added its output twice, 16 MiB: 114 MiB here.
    kept = runs * 4 * MIB
    assert grown <= kept * 1.25 + 16 * MIB, f"the database grew {grown / MIB:.1f} MiB"


def test_a_reconnect_after_the_retention_is_told_the_output_expired(tmp_path: Path) -> None:
    with (
        NoisyServer(tmp_path, "--output-retention", "1") as server,
        server.client(server.key_a) as http,
    ):
        sid = http.post("/v1/sandboxes", json={"spec": {"network": "deny-all"}}).json()["id"]
        exec_id, _, _ = _streamed_exec(http, sid, "echo hi")
        again = http.get(f"/v1/execs/{exec_id}/events", headers={"Last-Event-ID": "-1"})
        assert again.status_code == 200  # within the retention: replayed
        assert [name for name, _, _ in _events(again)][-1] == "result"
        time.sleep(2.5)
        late = http.get(f"/v1/execs/{exec_id}/events", headers={"Last-Event-ID": "-1"})
        assert late.status_code in (404, 410), late.text
        assert late.json()["code"] in ("not_found", "output_expired")
        assert "no longer kept" in late.json()["detail"] or "expired" in late.json()["detail"]
        http.delete(f"/v1/sandboxes/{sid}")
