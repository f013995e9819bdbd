"""A tenant never sees, touches, or learns of another tenant's objects: every route that takes
an id answers tenant B about tenant A's objects exactly as about ids that never existed (404),
and nothing of A's changes. The routes come from the app itself, so a new one cannot be
forgotten: one with no inputs listed here fails the walk."""

from __future__ import annotations

import json

import httpx
import pytest

from sandlot.client import Client
from sandlot.server.app import route_table
from sandlot.server.testing import ServerThread

# What each route needs besides its path ids, so that only the id decides the answer.
_INPUTS: dict[tuple[str, str], dict[str, object]] = {
    ("GET", "/v1/sandboxes/{sandbox_id}"): {},
    ("DELETE", "/v1/sandboxes/{sandbox_id}"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/destroy"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/stop"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/resume"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/keep-alive"): {"json": {"seconds": 60}},
    ("POST", "/v1/sandboxes/{sandbox_id}/exec"): {"json": {"command": "echo x"}},
    ("POST", "/v1/sandboxes/{sandbox_id}/execs"): {"json": {"command": "echo x"}},
    ("GET", "/v1/execs/{exec_id}/events"): {},
    ("PUT", "/v1/execs/{exec_id}/stdin"): {"content": b"input"},
    ("POST", "/v1/execs/{exec_id}/cancel"): {},
    ("GET", "/v1/sandboxes/{sandbox_id}/files/content"): {"params": {"path": "/workspace/secret"}},
    ("PUT", "/v1/sandboxes/{sandbox_id}/files/content"): {
        "params": {"path": "/workspace/secret"},
        "content": b"overwritten",
    },
    ("POST", "/v1/sandboxes/{sandbox_id}/files"): {
        "json": {"files": [{"path": "/workspace/secret", "content": "eA=="}]}
    },
    ("GET", "/v1/sandboxes/{sandbox_id}/files"): {"params": {"path": "/workspace"}},
    ("DELETE", "/v1/sandboxes/{sandbox_id}/files"): {
        "params": {"path": "/workspace/secret", "recursive": "true"}
    },
    ("GET", "/v1/sandboxes/{sandbox_id}/logs"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/snapshots"): {},
    ("DELETE", "/v1/snapshots/{snapshot_id}"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/restore"): {"json": {"snapshot_id": "{snapshot_id}"}},
    ("POST", "/v1/sandboxes/{sandbox_id}/fork"): {"json": {"count": 1}},
    ("POST", "/v1/snapshots/{snapshot_id}/fork"): {"json": {"count": 1}},
    ("POST", "/v1/sandboxes/{sandbox_id}/ports"): {"json": {"port": 8080}},
    ("GET", "/v1/sandboxes/{sandbox_id}/ports"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/reset"): {"json": {}},
    ("PUT", "/v1/sandboxes/{sandbox_id}/network"): {"json": {"network": "deny-all"}},
    ("GET", "/v1/sandboxes/{sandbox_id}/network/log"): {},
    ("GET", "/v1/sandboxes/{sandbox_id}/network/suggest"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/explain"): {
        "json": {"action": "exec", "args": {"command": "ls"}}
    },
    ("POST", "/v1/sandboxes/{sandbox_id}/processes"): {"json": {"command": "sleep 100"}},
    ("GET", "/v1/sandboxes/{sandbox_id}/processes"): {},
    ("POST", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/signal"): {"json": {"signal": 9}},
    ("POST", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/wait"): {"json": {"timeout": 1}},
    ("GET", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/output"): {},
    ("PUT", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin"): {
        "params": {"close": "true"},
        "content": b"input",
    },
    ("POST", "/v1/approvals/{approval_id}/approve"): {},
    ("POST", "/v1/approvals/{approval_id}/deny"): {},
}


def _routes_with_ids(server: ServerThread) -> list[tuple[str, str]]:
    assert server.app is not None
    # route_table, not app.routes: newer FastAPI keeps each included router as one entry.
    out = []
    for path, methods in route_table(server.app).items():
        if "{" in path:
            out.extend((m, path) for m in sorted(methods))
    return out


def _fill(template: object, ids: dict[str, str]) -> object:
    text = json.dumps(template)
    for name, value in ids.items():
        text = text.replace("{" + name + "}", value)
    return json.loads(text)


def _call(http: httpx.Client, method: str, path: str, ids: dict[str, str]) -> httpx.Response:
    spec = _INPUTS[(method, path)]
    url = path
    for name, value in ids.items():
        url = url.replace("{" + name + "}", value)
    return http.request(
        method,
        url,
        json=_fill(spec["json"], ids) if "json" in spec else None,
        params=spec.get("params"),  # type: ignore[arg-type]
        content=spec.get("content"),  # type: ignore[arg-type]
    )


def _scrub(body: str, ids: dict[str, str]) -> str:
    for value in ids.values():
        body = body.replace(value, "<id>")
    return body


def test_every_id_route_hides_other_tenants_objects(server: ServerThread) -> None:
    key_a, key_b = server.new_key("tenant-a"), server.new_key("tenant-b")
    with Client(server.url, key_a) as a:
        sb = a.create(start="serve")
        sb.write_file("/workspace/secret", "A's data")
        snap = sb.snapshot()
    headers_a = {"Authorization": f"Bearer {key_a}", "Accept": "text/event-stream"}
    with httpx.Client(base_url=server.url, headers=headers_a, timeout=30) as http_a:
        with http_a.stream(
            "POST", f"/v1/sandboxes/{sb.id}/execs", json={"command": "echo hi"}
        ) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data:"))
        exec_id = json.loads(first.removeprefix("data:"))["exec_id"]
    with Client(server.url, key_a) as a:
        (main,) = [p for p in a.get(sb.id).list_processes() if p.running]
    theirs = {
        "sandbox_id": sb.id,
        "snapshot_id": snap.id,
        "exec_id": exec_id,
        "process_id": main.id,
    }
    nobody = {
        "sandbox_id": "sb-0123456789ab",
        "snapshot_id": "snap-0123456789ab",
        "exec_id": "ex-0123456789ab",
        "process_id": "p-nobody",
    }

    routes = _routes_with_ids(server)
    missing = [r for r in routes if r not in _INPUTS]
    assert not missing, f"routes the tenancy walk does not know how to call: {missing}"
    assert len(routes) >= 20
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key_b}"}, timeout=30
    ) as b:
        for method, path in routes:
            other = _call(b, method, path, theirs)
            never = _call(b, method, path, nobody)
            assert other.status_code == 404, (method, path, other.status_code, other.text)
            assert other.headers["content-type"] == "application/problem+json", (method, path)
            assert other.json()["code"] == "not_found", (method, path)
            # Nothing in the answer tells an existing foreign object from a missing one.
            assert never.status_code == 404, (method, path, never.text)
            assert _scrub(other.text, theirs) == _scrub(never.text, nobody), (method, path)

        # Routes without ids: lists leave A's objects out, operator routes refuse B entirely.
        assert b.get("/v1/sandboxes", params={"include_destroyed": "true"}).json() == []
        assert b.get("/v1/snapshots").json() == []
        assert b.get("/v1/snapshots", params={"sandbox_id": sb.id}).json() == []
        assert b.get("/v1/approvals", params={"status": "all"}).json() == []
        refused = b.post("/v1/reconcile", json={"ids": [sb.id]})
        assert (refused.status_code, refused.json()["code"]) == (403, "policy_denied")
        assert b.post("/v1/stop-expired").status_code == 403

        # The terminal WebSocket refuses before the upgrade, with the same 404 for both.
        for ids in (theirs, nobody):
            refused = b.get(
                f"/v1/sandboxes/{ids['sandbox_id']}/pty",
                headers={
                    "Connection": "Upgrade",
                    "Upgrade": "websocket",
                    "Sec-WebSocket-Version": "13",
                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                },
            )
            assert refused.status_code == 404, refused.text
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.json()["code"] == "not_found"

    with Client(server.url, key_a) as a:
        again = a.get(sb.id)
        assert again.status.value == "running"
        assert [p.id for p in again.list_processes() if p.running] == [main.id]
        assert again.read_file("/workspace/secret") == b"A's data"
        assert [s.id for s in a.list_snapshots(sb.id)] == [snap.id]
        assert [s.id for s in a.list()] == [sb.id], "B's forks must not have been made for A"


@pytest.mark.parametrize(
    "header", [None, "Bearer nope", "Bearer sandlot_not-a-real-key", "Basic abc"]
)
def test_requests_without_a_valid_key_are_refused(server: ServerThread, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    r = httpx.get(f"{server.url}/v1/sandboxes", headers=headers)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "unauthenticated"


def test_revoked_key_stops_working(server: ServerThread) -> None:
    import anyio

    from sandlot.server.problems import Unauthenticated

    made = anyio.run(server.keys.create, "tenant-r")
    with Client(server.url, made.key) as c:
        assert c.list() == []
        anyio.run(server.keys.revoke, made.info.id)
        with pytest.raises(Unauthenticated):
            c.list()
        with pytest.raises(PermissionError):
            c.list()


def test_admin_sees_every_tenant(server: ServerThread) -> None:
    key_a = server.new_key("tenant-admin-a")
    admin = server.new_key("ops", admin=True)
    with Client(server.url, key_a) as a, Client(server.url, admin) as ops:
        sb = a.create()
        assert ops.get(sb.id).info.tenant == "tenant-admin-a"
        report = ops.reconcile([sb.id])
        assert report.checked == 1
        assert ops.stop_expired().errors == {}
