"""``sandlot write-file``, ``read-file`` and ``list-files``: moving files in and out.

Both directions are streamed: an upload is read from the host file (or standard input) as it
is sent, and a download is written as it arrives, through a temporary file renamed over the
target only once the whole file came, so a failed read leaves an existing file as it was. A
front end: it calls the SDK surface and nothing below it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sandlot.cli.app import _print_json, _run, app, out
from sandlot.cli.options import IdArg, JsonOpt, KeyOpt
from sandlot.errors import InvalidRequest

if TYPE_CHECKING:
    from sandlot.api import SandlotAPI

__all__ = ["list_files", "read_file", "write_file"]


@app.command("write-file")
def write_file(
    sandbox_id: IdArg,
    path: Annotated[
        str, typer.Argument(help="Absolute path inside the sandbox.", show_default=False)
    ],
    source: Annotated[
        str, typer.Argument(help="Host file to upload, or - for standard input.")
    ] = "-",
    mode: Annotated[
        str | None, typer.Option("--mode", help="Permission bits in octal, e.g. 755.")
    ] = None,
    idempotency_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a file into a sandbox from a host file or standard input."""

    async def body(client: SandlotAPI) -> object:
        try:
            bits = int(mode, 8) if mode is not None else None
        except ValueError:
            msg = f"--mode must be octal, got {mode!r}"
            raise InvalidRequest(msg) from None
        handle = await client.get(sandbox_id)
        if source == "-":
            # Streamed as it is read: a 1 GiB upload never sits in this process's memory.
            return await handle.write_file(
                path, sys.stdin.buffer, mode=bits, idempotency_key=idempotency_key
            )
        try:
            data = open(source, "rb")  # noqa: SIM115, ASYNC230 - closed below; opening is quick
        except OSError as e:
            msg = f"cannot read {source}: {e.strerror}"
            raise InvalidRequest(msg) from None
        with data:
            return await handle.write_file(path, data, mode=bits, idempotency_key=idempotency_key)

    info = _run(as_json, body)
    if as_json:
        _print_json(info)


@app.command("read-file")
def read_file(
    sandbox_id: IdArg,
    path: Annotated[
        str, typer.Argument(help="Absolute path inside the sandbox.", show_default=False)
    ],
    output: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Write to this host file instead of standard output."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a file from a sandbox (or save it with --out)."""

    async def body(client: SandlotAPI) -> int:
        handle = await client.get(sandbox_id)
        if output is None:
            size = 0
            async for chunk in handle.stream_file(path):
                sys.stdout.buffer.write(chunk)
                size += len(chunk)
            sys.stdout.buffer.flush()
            return size
        return await _download(handle.stream_file(path), output)

    size = _run(as_json, body)
    if as_json and output:
        _print_json({"path": path, "out": str(output), "size": size})


async def _download(chunks: AsyncIterator[bytes], output: Path) -> int:
    """Save a stream to ``output``. A regular file (or a new one) is written through a
    temporary file beside it, renamed over it only when the whole stream arrived, so a failed
    read (a wrong path, a broken connection) leaves an existing file as it was; a symlink is
    followed, and anything else (``/dev/null``, a FIFO, a terminal) is written in place."""
    import anyio
    import anyio.to_thread

    target, fd, tmp = await anyio.to_thread.run_sync(_open_download, output)
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
        if tmp is not None:
            await anyio.to_thread.run_sync(_put_in_place, tmp, target)
    except BaseException:
        if tmp is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(functools.partial(tmp.unlink, missing_ok=True))
        raise
    return size


def _open_download(output: Path) -> tuple[Path, int, Path | None]:
    """Where a download goes: the target (a symlink resolved), an open descriptor, and the
    temporary file to rename over the target at the end (None: written in place)."""
    target = Path(os.path.realpath(output.expanduser()))
    try:
        st = target.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        msg = f"cannot write {output}: {e.strerror}"
        raise InvalidRequest(msg) from None
    try:
        if st is not None and not stat.S_ISREG(st.st_mode):
            # A device or a pipe cannot be replaced by renaming (and must not be).
            return target, os.open(target, os.O_WRONLY | os.O_CLOEXEC), None
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        msg = f"cannot write {output}: {e.strerror}"
        raise InvalidRequest(msg) from None
    return target, fd, Path(name)


def _put_in_place(tmp: Path, target: Path) -> None:
    # The mode (and owner, where we may set it) a plain write would have kept or given it;
    # mkstemp makes files 0600.
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError):
        st = target.stat()
        tmp.chmod(st.st_mode & 0o7777)
        os.chown(tmp, st.st_uid, st.st_gid)
    if not target.exists():
        tmp.chmod(0o666 & ~umask)
    tmp.replace(target)


@app.command("list-files")
def list_files(
    sandbox_id: IdArg,
    path: Annotated[str | None, typer.Argument(help="Directory (default: the workdir).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List a directory in a sandbox."""

    async def body(client: SandlotAPI) -> list[object]:
        return list(await (await client.get(sandbox_id)).list_files(path))

    items = _run(as_json, body)
    if as_json:
        _print_json(items)
        return
    from pydantic import BaseModel
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("MODE", "SIZE", "NAME"):
        table.add_column(col)
    for f in items:
        assert isinstance(f, BaseModel)
        d = f.model_dump()
        name = (
            d["name"]
            + ("/" if d["type"] == "dir" else "")
            + (f" -> {d['target']}" if d["target"] else "")
        )
        table.add_row(oct(d["mode"])[2:], str(d["size"]), name)
    out.print(table)
