"""The OPA engine against a real HTTP server on loopback speaking OPA's Data API.

The server decides in Python: this tests our side of the wire protocol (what we send, how we
read every kind of answer, timeouts, refused connections), not OPA itself. When a real ``opa``
binary is on PATH, the last test runs the same checks against it with a Rego policy.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import anyio
import httpx
import pytest

from sandlot.policy import Decision, Explanation, Outcome, PolicyRequest, ReasonCode, load_engine
from sandlot.policy.opa import OpaEngine

from .conftest import exec_request, request


def decision(inp: dict) -> dict:
    """The policy the test server implements (default deny, like a well-written Rego policy)."""
    ctx = inp["context"]
    reasons = [
        "deny-rm-root"
        for cmd in ctx.get("commands", [])
        if cmd["program"] == "rm" and "recursive" in cmd["flags"] and "/" in cmd["paths"]
    ]
    if reasons:
        return {"allow": False, "reasons": reasons}
    if ctx.get("shell_undecidable"):
        return {"allow": True, "hold": "undecidable shell string"}
    if inp["principal"]["tenant"] != inp["resource"]["tenant"]:
        return {"allow": False, "reason_code": "NO_MATCHING_PERMIT"}
    return {"allow": True, "reasons": ["allow-agents"]}


class Handler(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, dict]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        # The client gives up in the timeout test: that is the point.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        payload = json.loads(self.rfile.read(length))
        Handler.received.append((self.path, payload))
        route = self.path.split("?")[0].removeprefix("/v1/data/")
        inp = payload["input"]
        if route == "sandlot/decision":
            self._reply(
                200,
                json.dumps(
                    {
                        "result": decision(inp),
                        "provenance": {"bundles": {"main": {"revision": "r42"}}},
                    }
                ).encode(),
            )
        elif route == "sandlot/allow":
            self._reply(200, json.dumps({"result": inp["action"] != "destroy"}).encode())
        elif route == "sandlot/undefined":
            self._reply(200, b"{}")
        elif route == "sandlot/slow":
            time.sleep(1.0)
            self._reply(200, b'{"result": true}')
        elif route == "sandlot/broken":
            self._reply(500, b'{"code": "internal_error"}')
        elif route == "sandlot/bad-input":
            self._reply(400, b'{"code": "invalid_parameter"}')
        elif route == "sandlot/garbage":
            self._reply(200, b"<html>not json</html>", "text/html")
        elif route == "sandlot/wrong-shape":
            self._reply(200, b'{"result": {"allow": "yes"}}')
        elif route == "sandlot/list":
            self._reply(200, b'{"result": [1, 2]}')
        else:
            self._reply(404, b"{}")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def ask(engine: OpaEngine, req: PolicyRequest) -> Decision:
    async def go() -> Decision:
        try:
            return await engine.decide(req)
        finally:
            await engine.aclose()

    return anyio.run(go)


def test_allow_deny_hold_from_an_object_result(server: str) -> None:
    engine = OpaEngine(server)
    d = ask(engine, exec_request("ls"))
    assert (d.outcome, d.reason_code, d.matched) == (
        Outcome.ALLOW,
        ReasonCode.OK,
        ("allow-agents",),
    )
    assert "bundle revision r42" in d.message
    d = ask(engine, exec_request("bash -lc 'rm -fr //'"))
    assert (d.outcome, d.reason_code, d.matched) == (
        Outcome.DENY,
        ReasonCode.POLICY_VIOLATION,
        ("deny-rm-root",),
    )
    d = ask(engine, exec_request("echo $HOME"))
    assert (d.outcome, d.hold_reason) == (Outcome.HOLD, "undecidable shell string")


def test_the_input_is_the_canonical_request(server: str) -> None:
    Handler.received.clear()
    req = exec_request("sudo rm -rf /tmp/x")
    ask(OpaEngine(server), req)
    path, payload = Handler.received[-1]
    assert path.startswith("/v1/data/sandlot/decision")
    assert payload == {"input": req.canonical()}
    assert payload["input"]["context"]["commands"][0]["via"] == ["sh", "sudo"]


def test_boolean_results(server: str) -> None:
    engine = OpaEngine(server, "sandlot/allow")
    assert ask(engine, request("stop")).outcome is Outcome.ALLOW
    d = ask(engine, request("destroy"))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.POLICY_VIOLATION)


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("sandlot/undefined", ReasonCode.POLICY_ERROR),
        ("sandlot/broken", ReasonCode.REMOTE_UNAVAILABLE),
        ("sandlot/bad-input", ReasonCode.POLICY_ERROR),
        ("sandlot/garbage", ReasonCode.POLICY_ERROR),
        ("sandlot/wrong-shape", ReasonCode.POLICY_ERROR),
        ("sandlot/list", ReasonCode.POLICY_ERROR),
        ("sandlot/missing", ReasonCode.POLICY_ERROR),
    ],
)
def test_every_bad_answer_fails_closed(server: str, path: str, code: ReasonCode) -> None:
    d = ask(OpaEngine(server, path), exec_request("ls"))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, code), d
    d = ask(OpaEngine(server, path, on_error="allow"), exec_request("ls"))
    assert (d.outcome, d.reason_code) == (Outcome.ALLOW, ReasonCode.POLICY_ERROR_FAIL_OPEN)


def test_a_timeout_denies(server: str) -> None:
    started = time.perf_counter()
    d = ask(OpaEngine(server, "sandlot/slow", timeout=0.2), exec_request("ls"))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.REMOTE_UNAVAILABLE)
    assert "timed out" in d.message
    assert time.perf_counter() - started < 0.9


def test_a_refused_connection_denies() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = ask(OpaEngine(f"http://127.0.0.1:{port}"), exec_request("ls"))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.REMOTE_UNAVAILABLE)


def test_explain_reports_the_result(server: str) -> None:
    async def go() -> Explanation:
        engine = OpaEngine(server)
        try:
            return await engine.explain(exec_request("rm -rf /"))
        finally:
            await engine.aclose()

    explanation = anyio.run(go)
    assert explanation.decision.outcome is Outcome.DENY
    assert any("deny-rm-root" in n for n in explanation.notes)
    assert Handler.received[-1][0].endswith("?explain=notes&provenance=true")


def test_load_engine_builds_opa(server: str) -> None:
    engine = load_engine({"engine": "opa", "url": server, "path": "sandlot/decision", "timeout": 1})
    assert engine.name == "opa"
    assert isinstance(engine, OpaEngine)
    assert engine.endpoint == f"{server}/v1/data/sandlot/decision"


def test_bad_configuration() -> None:
    from sandlot.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        OpaEngine("ftp://x")
    with pytest.raises(InvalidRequest):
        OpaEngine("http://x", "/")
    with pytest.raises(InvalidRequest):
        load_engine({"engine": "opa"})


REGO = """
package sandlot
import rego.v1

default decision := {"allow": false, "reasons": []}

deny contains "deny-rm-root" if {
    some cmd in input.context.commands
    cmd.program == "rm"
    "recursive" in cmd.flags
    "/" in cmd.paths
}

decision := {"allow": true, "reasons": ["allow-all"]} if count(deny) == 0
decision := {"allow": false, "reasons": deny} if count(deny) > 0
"""


@pytest.mark.skipif(
    shutil.which("opa") is None, reason="needs the opa binary on PATH (not packaged in Debian)"
)
def test_against_a_real_opa_server(tmp_path: Path) -> None:
    policy = tmp_path / "sandlot.rego"
    policy.write_text(REGO)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["opa", "run", "--server", f"--addr=127.0.0.1:{port}", str(policy)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(f"{url}/health", timeout=0.2)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert ask(OpaEngine(url), exec_request("ls")).outcome is Outcome.ALLOW
        d = ask(OpaEngine(url), exec_request("sudo rm -fr //"))
        assert (d.outcome, d.matched) == (Outcome.DENY, ("deny-rm-root",))
        assert (
            ask(OpaEngine(url, "sandlot/nothing"), exec_request("ls")).reason_code
            is ReasonCode.POLICY_ERROR
        )
    finally:
        proc.terminate()
        proc.wait(5)
