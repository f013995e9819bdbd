"""The one sandbox handle over a recording ControlPlane: what each call hands the plane (one
request model for exec and start_process, the defaults the handle fills in), which record it
keeps, and that both clients' handles are this class."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from sandlot.errors import NotFound
from sandlot.handle import AsyncSandbox
from sandlot.models import (
    CommandSpec,
    ExecResult,
    FileInfo,
    OutputChunk,
    PortMapping,
    ProcessInfo,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
)
from sandlot.wire import ExecRequest, StartProcessRequest


def _info(status: SandboxStatus = SandboxStatus.RUNNING, sandbox_id: str = "sb-1") -> SandboxInfo:
    return SandboxInfo(
        id=sandbox_id, backend="fake", status=status, spec=SandboxSpec(workdir="/work")
    )


class RecordingPlane:
    """Records each call; answers with fixed records."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))

    async def get(self, sandbox_id: str) -> SandboxInfo:
        self._record("get", sandbox_id)
        return _info(SandboxStatus.STOPPED, sandbox_id)

    async def exec(self, sandbox_id: str, request: ExecRequest, **kwargs: Any) -> ExecResult:
        self._record("exec", sandbox_id, request, **kwargs)
        callback = kwargs["on_output"]
        if callback is not None:
            await callback(OutputChunk(seq=0, stream="stdout", data="h\xe9".encode()[:2]))
            await callback(OutputChunk(seq=1, stream="stdout", data="h\xe9".encode()[2:]))
        return ExecResult(exit_code=0)

    async def start_process(self, sandbox_id: str, request: StartProcessRequest) -> ProcessInfo:
        self._record("start_process", sandbox_id, request)
        return ProcessInfo(id="p-1", pid=7, command=["true"])

    async def write_stdin(self, sandbox_id: str, process_id: str, data: bytes, **kw: Any) -> None:
        self._record("write_stdin", sandbox_id, process_id, data, **kw)

    async def list_files(self, sandbox_id: str, path: str) -> list[FileInfo]:
        self._record("list_files", sandbox_id, path)
        return []

    async def write_file(self, sandbox_id: str, path: str, body: Any, **kw: Any) -> FileInfo:
        data = body if isinstance(body, bytes) else b"".join([c async for c in body])
        self._record("write_file", sandbox_id, path, data, **kw)
        return FileInfo(path=path, name=path.rsplit("/", 1)[-1], type="file", size=len(data))

    async def stream_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        self._record("stream_file", sandbox_id, path)
        yield b"a"
        yield b"b"

    async def fork(self, source: str, count: int) -> list[SandboxInfo]:
        self._record("fork", source, count)
        return [_info(sandbox_id=f"sb-{i + 2}") for i in range(count)]

    async def expose_port(self, sandbox_id: str, port: int) -> PortMapping:
        self._record("expose_port", sandbox_id, port)
        return PortMapping(
            port=port, host="127.0.0.1", host_port=40000, url="http://127.0.0.1:40000"
        )

    async def explain(self, sandbox_id: str, action: str, args: dict[str, object]) -> object:
        self._record("explain", sandbox_id, action, args)
        return "explained"

    async def destroy(self, sandbox_id: str, **kw: Any) -> SandboxInfo:
        self._record("destroy", sandbox_id, **kw)
        raise NotFound(sandbox_id)


@pytest.fixture
def plane() -> RecordingPlane:
    return RecordingPlane()


@pytest.fixture
def sb(plane: RecordingPlane) -> AsyncSandbox:
    return AsyncSandbox(plane, _info())  # type: ignore[arg-type]


async def test_exec_sends_one_request_model(plane: RecordingPlane, sb: AsyncSandbox) -> None:
    text: list[str] = []
    result = await sb.exec(
        ("echo", "hi"),
        env={"A": "1"},
        timeout=5,
        stdin=b"in",
        idempotency_key="k",
        on_stdout=text.append,
    )
    assert result.exit_code == 0
    ((name, (sandbox_id, request), kwargs),) = plane.calls
    assert (name, sandbox_id) == ("exec", "sb-1")
    assert isinstance(request, ExecRequest)
    assert request.command == ["echo", "hi"]  # any sequence becomes the model's argv list
    assert (request.cwd, request.env, request.timeout) == (None, {"A": "1"}, 5)
    assert (request.check, request.auto_resume, request.collect_output) == (False, True, True)
    assert kwargs["stdin"] == b"in"
    assert kwargs["idempotency_key"] == "k"
    # The text callbacks are folded into one chunk callback, decoding across chunk edges.
    assert "".join(text) == "h\xe9"


async def test_exec_keeps_a_string_or_a_spec_as_given(
    plane: RecordingPlane, sb: AsyncSandbox
) -> None:
    spec = CommandSpec(cmd="ls", args=["-l"])
    await sb.exec("ls | wc -l")
    await sb.exec(spec)
    assert [c[1][1].command for c in plane.calls] == ["ls | wc -l", spec]
    assert all(c[2]["on_output"] is None for c in plane.calls)


async def test_start_process_sends_its_model(plane: RecordingPlane, sb: AsyncSandbox) -> None:
    await sb.start_process(["sleep", "9"], cwd="/tmp", name="nap")
    ((_, (_, request), _),) = plane.calls
    assert isinstance(request, StartProcessRequest)
    assert (request.command, request.cwd, request.env, request.name) == (
        ["sleep", "9"],
        "/tmp",
        {},
        "nap",
    )


async def test_the_handle_shapes_arguments_once(plane: RecordingPlane, sb: AsyncSandbox) -> None:
    await sb.write_stdin("p-1", "text", close=True)
    await sb.list_files()
    await sb.write_file("/work/a", "text")
    assert [c async for c in sb.stream_file("/work/a")] == [b"a", b"b"]
    assert plane.calls[0] == ("write_stdin", ("sb-1", "p-1", b"text"), {"close": True})
    assert plane.calls[1] == ("list_files", ("sb-1", "/work"), {})  # default: the workdir
    assert plane.calls[2][1] == ("sb-1", "/work/a", b"text")


async def test_records_kept_and_handles_made(plane: RecordingPlane, sb: AsyncSandbox) -> None:
    mapping = await sb.expose_port(8080)
    assert mapping.port == 8080
    assert sb.status is SandboxStatus.STOPPED  # refreshed after publishing the port
    forks = await sb.fork(2)
    assert [type(f) for f in forks] == [AsyncSandbox, AsyncSandbox]
    assert [f.id for f in forks] == ["sb-2", "sb-3"]
    assert forks[0]._plane is plane
    assert await sb.explain("exec", command="rm -rf /") == "explained"
    assert plane.calls[-1] == ("explain", ("sb-1", "exec", {"command": "rm -rf /"}), {})


async def test_async_with_destroys_even_when_destroy_fails(plane: RecordingPlane) -> None:
    with pytest.raises(NotFound):
        async with AsyncSandbox(plane, _info()):  # type: ignore[arg-type]
            pass
    assert plane.calls[-1] == (
        "destroy",
        ("sb-1",),
        {"idempotency_key": None, "forget_host": False},
    )
