"""The in-process transport MCP-over-HTTP uses: it streams like a socket, not like a buffer."""

from __future__ import annotations

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from sandlot.server.inprocess import AppTransport


async def test_body_chunks_reach_the_reader_while_the_app_still_runs() -> None:
    go_on = anyio.Event()

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-a", b"1")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await go_on.wait()  # a buffering transport would never return the response
        await send({"type": "http.response.body", "body": b"second", "more_body": False})

    async with anyio.create_task_group() as tg:
        transport = AppTransport(app, tg.start_soon)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            with anyio.fail_after(5):
                async with client.stream("GET", "/") as response:
                    assert response.status_code == 201
                    assert response.headers["x-a"] == "1"
                    chunks = response.aiter_bytes()
                    assert await chunks.__anext__() == b"first"
                    go_on.set()
                    assert [c async for c in chunks] == [b"second"]


async def test_a_reader_that_closes_early_is_a_client_that_hung_up() -> None:
    ended = anyio.Event()

    async def forever(request: Request) -> StreamingResponse:
        async def body():
            try:
                while True:
                    yield b"tick\n"
                    await anyio.sleep(0.01)
            finally:
                ended.set()

        return StreamingResponse(body())

    app = Starlette(routes=[Route("/", forever)])
    async with anyio.create_task_group() as tg:
        transport = AppTransport(app, tg.start_soon)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            with anyio.fail_after(5):
                async with client.stream("GET", "/") as response:
                    async for chunk in response.aiter_bytes():
                        assert chunk.startswith(b"tick")
                        break
                await ended.wait()  # the endless stream was told its client left


async def test_the_request_body_and_query_reach_the_app() -> None:
    async def echo(request: Request) -> StreamingResponse:
        data = b"".join([c async for c in request.stream()])
        return StreamingResponse(iter([request.url.query.encode(), b"|", data]))

    app = Starlette(routes=[Route("/echo", echo, methods=["PUT"])])

    async def parts():
        yield b"one,"
        yield b"two"

    async with anyio.create_task_group() as tg:
        transport = AppTransport(app, tg.start_soon)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            with anyio.fail_after(5):
                response = await client.put("/echo?a=1", content=parts())
    assert response.content == b"a=1|one,two"


async def test_an_app_that_fails_before_answering_gives_500_and_the_server_lives_on() -> None:
    async def broken(scope, receive, send) -> None:
        msg = "boom"
        raise RuntimeError(msg)

    async with anyio.create_task_group() as tg:
        transport = AppTransport(broken, tg.start_soon)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            with anyio.fail_after(5):
                first = await client.get("/")
                second = await client.get("/")
    assert (first.status_code, first.text) == (500, "Internal Server Error")
    assert second.status_code == 500
