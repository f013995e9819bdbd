"""The HTTP API as a client on the wire sees it: problem documents, streaming and resuming
exec output, file digests and limits, quotas with an admission queue, metrics."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest

from sandlot import BackendUnavailable, ExecFailed, InvalidRequest, QuotaExceeded
from sandlot.client import AsyncClient, Client
from sandlot.server import Quota, ServerConfig
from sandlot.server.testing import ServerThread
from sandlot.testing import FakeBackend

from .conftest import ChattyBackend


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _events(lines: list[str]) -> list[tuple[str | None, str, dict[str, object]]]:
    out, event, eid = [], "message", None
    for line in lines:
        if line.startswith("id: "):
            eid = line[4:]
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            out.append((eid, event, json.loads(line[6:])))
            event, eid = "message", None
    return out


def test_service_endpoints_and_openapi(server: ServerThread, tenant_key: str) -> None:
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    version = httpx.get(f"{server.url}/version").json()
    assert version["api"] == "v1"
    assert "fake" in version["backends"]
    spec = httpx.get(f"{server.url}/openapi.json", headers=_auth(tenant_key)).json()
    paths = spec["paths"]
    for path in ("/v1/sandboxes", "/v1/sandboxes/{sandbox_id}/execs", "/v1/execs/{exec_id}/events"):
        assert path in paths
    assert "/mcp" not in paths
    assert "HTTPBearer" in json.dumps(spec["components"]["securitySchemes"])


DOCS = ("/openapi.json", "/docs", "/docs/oauth2-redirect")


def test_the_api_description_needs_a_key(server: ServerThread, tenant_key: str) -> None:
    for path in DOCS:
        for headers in ({}, _auth("sandlot_not-a-real-key")):
            refused = httpx.get(f"{server.url}{path}", headers=headers)
            assert refused.status_code == 401, (path, refused.text)
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.json()["code"] == "unauthenticated"
            assert "--public-docs" in refused.json()["detail"]
            assert "/v1/sandboxes" not in refused.text
        assert httpx.get(f"{server.url}{path}", headers=_auth(tenant_key)).status_code == 200


def test_a_server_can_make_its_api_description_public(tmp_path: Path) -> None:
    config = ServerConfig(docs_public=True, sweep_interval=None)
    with ServerThread(tmp_path, backends={"fake": FakeBackend()}, config=config) as server:
        for path in DOCS:
            assert httpx.get(f"{server.url}{path}").status_code == 200, path
        assert "/v1/sandboxes" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
        # Only the description: the API itself still needs a key.
        assert httpx.get(f"{server.url}/v1/sandboxes").status_code == 401


def test_errors_are_problem_documents_with_stable_codes(
    server: ServerThread, tenant_key: str
) -> None:
    with httpx.Client(base_url=server.url, headers=_auth(tenant_key)) as http:
        missing = http.get("/v1/sandboxes/sb-ffffffffffff")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/problem+json"
        body = missing.json()
        assert body["code"] == "not_found"
        assert body["type"] == "urn:sandlot:error:not_found"
        assert "sb-ffffffffffff" in body["detail"]
        bad = http.post("/v1/sandboxes", json={"spec": {"workdir": "relative"}})
        assert (bad.status_code, bad.json()["code"]) == (422, "invalid_request")
        assert "workdir" in bad.json()["detail"]
        huge = http.post("/v1/sandboxes", json={"spec": {"timeout": 1e300}})
        assert huge.status_code == 422
        sb = http.post("/v1/sandboxes", json={}).json()
        failed = http.post(
            f"/v1/sandboxes/{sb['id']}/exec", json={"command": "exit 3", "check": True}
        )
        assert (failed.status_code, failed.json()["code"]) == (422, "exec_failed")
        assert failed.json()["result"]["exit_code"] == 3
        ok = http.post(f"/v1/sandboxes/{sb['id']}/exec", json={"command": ["echo", "a b"]})
        assert ok.json()["stdout"] == "a b\n"
        keyed = http.post(f"/v1/sandboxes/{sb['id']}/stop", headers={"Idempotency-Key": "stop-1"})
        assert keyed.status_code == 200
        bad_key = http.post(f"/v1/sandboxes/{sb['id']}/stop", headers={"Idempotency-Key": "a b"})
        assert bad_key.status_code == 422
        assert http.get("/v1/no-such-route").json()["code"] == "not_found"


def test_exec_stream_resumes_after_last_event_id_without_loss_or_duplicates(
    server: ServerThread, tenant_key: str
) -> None:
    with httpx.Client(base_url=server.url, headers=_auth(tenant_key), timeout=30) as http:
        sb = http.post("/v1/sandboxes", json={}).json()
        seen: list[str] = []
        with http.stream(
            "POST", f"/v1/sandboxes/{sb['id']}/execs", json={"command": ["chatty", "40", "0.01"]}
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                got = _events(lines)
                if sum(1 for _, e, _ in got if e == "output") >= 5:
                    break  # drop the connection mid-command
        first = _events(lines)
        assert first[0][1] == "started"
        exec_id = str(first[0][2]["exec_id"])
        outputs = [(eid, d) for eid, e, d in first if e == "output"]
        assert [eid for eid, _ in outputs] == ["0", "1", "2", "3", "4"]
        seen += [base64.b64decode(str(d["data"])).decode() for _, d in outputs]
        resumed = http.get(f"/v1/execs/{exec_id}/events", headers={"Last-Event-ID": "4"})
        rest = _events(resumed.text.splitlines())
        assert rest[0][0] == "5", "resumes right after the last id the client had"
        seen += [base64.b64decode(str(d["data"])).decode() for _, e, d in rest if e == "output"]
        assert rest[-1][1] == "result"
        assert seen == [f"line {i}\n" for i in range(40)]
        again = http.get(f"/v1/execs/{exec_id}/events", headers={"Last-Event-ID": "38"})
        assert [eid for eid, e, _ in _events(again.text.splitlines()) if e == "output"] == ["39"]
        assert (
            http.get(f"/v1/execs/{exec_id}/events", headers={"Last-Event-ID": "x"}).status_code
            == 422
        )
        assert http.get("/v1/execs/ex-000000000000/events").status_code == 404


class _CuttingProxy:
    """A loopback TCP proxy that cuts each of the first ``cuts`` connections after ``after``
    response bytes, so a client sees its stream break in the middle."""

    def __init__(self, target_port: int, after: int, cuts: int) -> None:
        import socket

        self.target_port, self.after, self.cuts = target_port, after, cuts
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            cut = self.cuts > 0
            self.cuts -= 1 if cut else 0
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, client, self.after if cut else None), daemon=True
            ).start()

    @staticmethod
    def _pipe(src: object, dst: object, limit: int | None) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)  # type: ignore[attr-defined]
                if not data:
                    break
                if limit is not None and sent + len(data) > limit:
                    dst.sendall(data[: limit - sent])  # type: ignore[attr-defined]
                    break
                dst.sendall(data)  # type: ignore[attr-defined]
                sent += len(data)
        except OSError:
            pass
        finally:
            import contextlib
            import socket

            for s in (src, dst):
                # shutdown, not just close: the other direction's thread is blocked in recv on
                # the same socket, and only shutdown wakes it and sends the FIN.
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
                s.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._stop = True
        self.sock.close()


async def test_client_reconnects_a_broken_exec_stream_and_runs_the_command_once(
    server: ServerThread, tenant_key: str, shared_fake: FakeBackend
) -> None:
    proxy = _CuttingProxy(server.port, after=1500, cuts=1)
    try:
        async with AsyncClient(f"http://127.0.0.1:{proxy.port}", tenant_key) as client:
            sb = await client.create()
            chunks: list[int] = []
            result = await sb.exec(
                ["chatty", "60", "0.005"], on_output=lambda c: chunks.append(c.seq)
            )
        assert chunks == list(range(60)), "every chunk once, in order"
        assert result.stdout == "".join(f"line {i}\n" for i in range(60))
        assert (
            len([c for c in shared_fake.calls_for(sb.id, "exec") if c.args["argv"][0] == "chatty"])
            == 1
        )
        assert proxy.connections >= 2, "the cut connection, then the resumed stream"
    finally:
        proxy.close()


def test_server_restart_mid_exec_is_outcome_unknown_never_a_rerun(tmp_path: Path) -> None:
    fake = FakeBackend()
    with ServerThread(tmp_path, backends={"fake": ChattyBackend(fake)}) as server:  # type: ignore[dict-item]
        key = server.new_key("restarts")
        with Client(server.url, key, reconnect_timeout=10) as client:
            sb = client.create()
            got: list[int] = []
            restarted = threading.Event()

            def on_output(chunk: object) -> None:
                got.append(chunk.seq)  # type: ignore[attr-defined]
                if chunk.seq == 2 and not restarted.is_set():  # type: ignore[attr-defined]
                    restarted.set()
                    threading.Thread(target=server.restart, daemon=True).start()

            started = time.monotonic()
            with pytest.raises(BackendUnavailable, match="outcome is unknown") as info:
                sb.exec(["chatty", "200", "0.02"], on_output=on_output)
            assert info.value.details["outcome"] == "unknown"
            assert time.monotonic() - started < 15
            assert got[:3] == [0, 1, 2]
            assert got == sorted(set(got)), "no chunk twice"
            execs = [c for c in fake.calls_for(sb.id, "exec") if c.args["argv"][0] == "chatty"]
            assert len(execs) == 1, "the command was not sent again"
            # The restarted server still serves the sandbox.
            assert client.get(sb.id).exec("echo alive").stdout == "alive\n"


def test_file_digests_and_size_limits(tmp_path: Path) -> None:
    fake = FakeBackend()
    config = ServerConfig(max_upload_bytes=1 << 20, max_download_bytes=2 << 20, sweep_interval=None)
    with ServerThread(tmp_path, backends={"fake": fake}, config=config) as server:
        key = server.new_key("files")
        with Client(server.url, key) as client:
            sb = client.create()
            blob = bytes(range(256)) * 4000  # ~1 MB, under both limits
            sb.write_file("/workspace/blob", blob)
            assert sb.read_file("/workspace/blob") == blob
            with pytest.raises(InvalidRequest, match="limit"):
                sb.write_file("/workspace/big", b"x" * ((1 << 20) + 1))
            assert "/workspace/big" not in [f.path for f in sb.list_files()]
        with httpx.Client(base_url=server.url, headers=_auth(key)) as http:
            url = f"/v1/sandboxes/{sb.id}/files/content"
            too_big = http.put(
                url, params={"path": "/workspace/big"}, content=b"x" * ((1 << 20) + 1)
            )
            assert too_big.status_code == 413
            assert too_big.json()["code"] == "invalid_request"
            wrong = "sha-256=:" + base64.b64encode(hashlib.sha256(b"other").digest()).decode() + ":"
            corrupted = http.put(
                url,
                params={"path": "/workspace/c"},
                content=b"data",
                headers={"Content-Digest": wrong},
            )
            assert corrupted.status_code == 422
            assert "corrupted" in corrupted.json()["detail"]
            assert "/workspace/c" not in [
                f["path"]
                for f in http.get(
                    f"/v1/sandboxes/{sb.id}/files", params={"path": "/workspace"}
                ).json()
            ]
            down = http.get(url, params={"path": "/workspace/blob"})
            assert (
                down.headers["content-digest"]
                == "sha-256=:" + base64.b64encode(hashlib.sha256(blob).digest()).decode() + ":"
            )
            assert int(down.headers["content-length"]) == len(blob)
            fake.sandboxes[f"fake-{sb.id}"].files["/workspace/huge"] = b"y" * ((2 << 20) + 1)
            refused = http.get(url, params={"path": "/workspace/huge"})
            assert refused.status_code == 413
            assert "limit" in refused.json()["detail"]


async def test_quota_waits_in_line_then_429(tmp_path: Path) -> None:
    fake = FakeBackend()
    config = ServerConfig(
        quota=Quota(max_live_sandboxes=1, max_concurrent_execs=1),
        admission_timeout=1.0,
        admission_queue=1,
        sweep_interval=None,
    )
    with ServerThread(tmp_path, backends={"fake": fake}, config=config) as server:
        key = server.new_key("small")
        async with AsyncClient(server.url, key) as client:
            first = await client.create()
            started = time.monotonic()
            with pytest.raises(QuotaExceeded, match="limit of 1 live sandboxes"):
                await client.create()
            assert time.monotonic() - started >= 0.9, "it waited for the deadline first"

            # A destroy during the wait lets the waiting create through.
            async def free_soon() -> None:
                await anyio.sleep(0.3)
                await first.destroy()

            async with anyio.create_task_group() as tg:
                tg.start_soon(free_soon)
                second = await client.create()
            assert second.status.value == "running"

            # The queue is bounded: with one request waiting, the next is refused at once.
            results: list[str] = []

            async def waiter() -> None:
                try:
                    await client.create()
                    results.append("created")
                except QuotaExceeded:
                    results.append("timed out")

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.2)
                t0 = time.monotonic()
                with pytest.raises(QuotaExceeded, match="already wait"):
                    await client.create()
                assert time.monotonic() - t0 < 0.5
            assert results == ["timed out"]

            # Concurrent execs: the second waits for the first rather than failing.
            t0 = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(second.exec, "sleep 0.6")
                await anyio.sleep(0.1)
                assert (await second.exec("echo next")).stdout == "next\n"
            assert time.monotonic() - t0 >= 0.6


def test_metrics(server: ServerThread, tenant_key: str) -> None:
    admin = server.new_key("ops-metrics", admin=True)
    with Client(server.url, tenant_key) as client:
        sb = client.create()
        sb.exec("echo hi")
        with pytest.raises(ExecFailed):
            sb.exec("exit 2", check=True)
    assert httpx.get(f"{server.url}/metrics", headers=_auth(tenant_key)).status_code == 403
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    text = httpx.get(f"{server.url}/metrics", headers=_auth(admin)).text
    assert 'sandlot_sandboxes{backend="fake",status="running"}' in text
    assert "sandlot_exec_duration_seconds_bucket" in text
    assert 'sandlot_exec_duration_seconds_count{outcome="ok"}' in text
    assert 'sandlot_exec_duration_seconds_count{outcome="error"}' in text
    assert 'sandlot_policy_decisions_total{outcome="deny"}' in text
    assert 'route="/v1/sandboxes/{sandbox_id}/execs"' in text


def test_every_upload_route_names_the_one_configured_limit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 13 item 16: with --max-upload-mb 1 a raw upload said 1463637 bytes (the JSON
    allowance) or 1048576 bytes, depending on how it was sent."""
    import base64

    from sandlot.server import ServerConfig
    from sandlot.server.testing import ServerThread
    from sandlot.testing import FakeBackend

    config = ServerConfig(sweep_interval=None, max_upload_bytes=1 << 20)
    with ServerThread(tmp_path / "srv", backends={"fake": FakeBackend()}, config=config) as srv:
        key = srv.new_key("acme")
        with Client(srv.url, key) as c:
            sb = c.create()
        auth = {"Authorization": f"Bearer {key}"}
        url = f"{srv.url}/v1/sandboxes/{sb.id}"
        body = b"x" * 2_000_000

        def chunked():  # type: ignore[no-untyped-def]
            yield body[:1_000_000]
            yield body[1_000_000:]

        answers = [
            httpx.put(f"{url}/files/content", params={"path": "/w/a"}, content=body, headers=auth),
            httpx.put(
                f"{url}/files/content", params={"path": "/w/a"}, content=chunked(), headers=auth
            ),
            httpx.post(
                f"{url}/files",
                json={
                    "files": [
                        {"path": "/w/b", "content": base64.b64encode(b"y" * 1_100_000).decode()}
                    ]
                },
                headers=auth,
            ),
        ]
        for r in answers:
            assert r.status_code == 413, r.text
            assert r.json()["details"]["limit"] == 1 << 20
            assert "upload limit of 1048576 bytes" in r.json()["detail"]
