"""File writes that stream: file objects and chunk iterables, through every SDK (issue 13
item 15: a file object failed with ``TypeError: 'async for' requires …``)."""

from __future__ import annotations

import hashlib
import io
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandlot import InvalidRequest
from sandlot.sdk import AsyncSandlot
from sandlot.sync import Sandlot


async def test_async_write_file_takes_a_binary_file_and_async_chunks(
    aclient: AsyncSandlot, tmp_path: Path
) -> None:
    sb = await aclient.create()
    source = tmp_path / "data.bin"
    source.write_bytes(b"x" * 3_000_000)
    with open(source, "rb") as f:
        info = await sb.write_file("/workspace/a.bin", f)
    assert info.size == 3_000_000
    assert await sb.read_file("/workspace/a.bin") == source.read_bytes()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"part {i}\n".encode()

    await sb.write_file("/workspace/b.txt", chunks())
    assert await sb.read_file("/workspace/b.txt") == b"part 0\npart 1\npart 2\n"
    # The receipt of a streamed write carries the content's hash, as for bytes.
    await aclient.manager.flush_receipts()
    executions = [
        r.body
        for r in aclient.receipts.tail(20, sandbox_id=sb.id)
        if r.type == "execution" and r.body["op"] == "fs.write"
    ]
    expected = "sha256:" + hashlib.sha256(b"part 0\npart 1\npart 2\n").hexdigest()
    assert executions[-1]["output_hash"] == expected


async def test_a_text_mode_file_is_refused_with_the_fix(
    aclient: AsyncSandlot, tmp_path: Path
) -> None:
    sb = await aclient.create()
    source = tmp_path / "t.txt"
    source.write_text("hello")
    with open(source) as f, pytest.raises(InvalidRequest, match="binary mode"):
        await sb.write_file("/workspace/t.txt", f)  # type: ignore[arg-type]


def test_sync_write_file_takes_a_file_object_and_an_iterable(client: Sandlot) -> None:
    sb = client.create()
    sb.write_file("/workspace/a", io.BytesIO(b"from a file object"))
    assert sb.read_file("/workspace/a") == b"from a file object"
    sb.write_file("/workspace/b", (bytes([65 + i]) for i in range(5)))
    assert sb.read_file("/workspace/b") == b"ABCDE"


def test_a_keyed_streamed_write_is_remembered_by_its_content(client: Sandlot) -> None:
    """Review of issue 13: the key remembered a stream only as "a stream", so the same key
    with other content silently returned the first result and wrote nothing."""
    from sandlot import Conflict

    sb = client.create()
    sb.write_file("/workspace/k", io.BytesIO(b"first"), idempotency_key="w-1")
    sb.write_file("/workspace/k", io.BytesIO(b"first"), idempotency_key="w-1")  # a replay
    with pytest.raises(Conflict):
        sb.write_file("/workspace/k", io.BytesIO(b"other"), idempotency_key="w-1")
    assert sb.read_file("/workspace/k") == b"first"
