"""Uploads cannot fill the server's memory: a real `sandlot serve` (local backend) takes four
concurrent 200 MiB chunked uploads from one tenant with its peak resident memory (VmHWM) barely
moving, because each upload is spooled to disk, not held (it was +1.5 GB)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from .noisy import NoisyServer

pytestmark = [pytest.mark.slow]

MIB = 1 << 20
UPLOADS = 4
UPLOAD_MIB = 200
RSS_GROWTH_MIB = 96
"""What the server's peak may grow by: far below one upload, let alone four."""


def _vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    msg = f"no VmHWM in /proc/{pid}/status"
    raise AssertionError(msg)


def _body() -> Iterator[bytes]:
    chunk = b"u" * MIB
    for _ in range(UPLOAD_MIB):
        yield chunk


def test_concurrent_chunked_uploads_do_not_grow_server_memory(tmp_path: Path) -> None:
    with NoisyServer(tmp_path) as server:
        assert server._proc is not None
        pid = server._proc.pid
        with server.client(server.key_b, timeout=300) as http:
            made = http.post("/v1/sandboxes", json={"spec": {"network": "deny-all"}})
            assert made.status_code == 201, made.text
            sb = made.json()["id"]
            url = f"/v1/sandboxes/{sb}/files/content"
            warm = http.put(url, params={"path": "/tmp/warm"}, content=b"w" * (2 * MIB))
            assert warm.status_code == 200, warm.text
            before = _vm_hwm_mib(pid)
            answers: list[tuple[int, str]] = []

            def upload(i: int) -> None:
                # A generator body goes out chunked, with no Content-Length for the server to
                # size anything by.
                r = http.put(url, params={"path": f"/tmp/upload-{i}"}, content=_body())
                answers.append((r.status_code, r.text))

            threads = [threading.Thread(target=upload, args=(i,)) for i in range(UPLOADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            growth = _vm_hwm_mib(pid) - before
            assert [status for status, _ in answers] == [200] * UPLOADS, answers
            assert all(f'"size":{UPLOAD_MIB * MIB}' in text for _, text in answers), answers
            print(
                f"server VmHWM: {before:.0f} MiB, +{growth:.1f} MiB after {UPLOADS} x {UPLOAD_MIB} MiB"
            )
            assert growth < RSS_GROWTH_MIB, (
                f"the server's peak memory grew from {before:.0f} MiB by {growth:.0f} MiB"
            )
