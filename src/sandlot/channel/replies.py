"""The agent's replies read into wire models, and the checks a request passes before it is sent.

Tolerant readers (a field of the wrong type reads as its default) shared by the operations in
:mod:`.client` and :mod:`.pty`. Imports only the wire models, the errors and :mod:`.protocol`.
"""

from __future__ import annotations

from typing import Literal

from sandlot.channel.protocol import Chan, error_from_reply
from sandlot.errors import InvalidRequest
from sandlot.models import FileInfo, ProcessInfo

__all__ = [
    "abs_path",
    "as_float",
    "as_int",
    "check_argv",
    "file_info",
    "label",
    "opt_int",
    "process_info",
    "unwrap",
]


def label(chan: int) -> Literal["stdout", "stderr"]:
    return "stderr" if chan == Chan.ERR else "stdout"


def unwrap(end: dict[str, object]) -> dict[str, object]:
    if end.get("ok") is True:
        result = end.get("result")
        return result if isinstance(result, dict) else {}
    raise error_from_reply(end.get("error"))


def abs_path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        msg = f"paths inside a sandbox must be absolute, got {path!r}"
        raise InvalidRequest(msg)
    if "\x00" in path:
        msg = "a path must not contain NUL bytes"
        raise InvalidRequest(msg)
    return path


def check_argv(argv: list[str]) -> list[str]:
    if not argv or not all(isinstance(a, str) for a in argv):
        msg = "argv must be a non-empty list of strings"
        raise InvalidRequest(msg)
    return list(argv)


def as_int(v: object, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def as_float(v: object, default: float = 0.0) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def opt_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def file_info(obj: dict[str, object]) -> FileInfo:
    kind = obj.get("type")
    target = obj.get("target")
    return FileInfo(
        path=str(obj.get("path", "")),
        name=str(obj.get("name", "")),
        type=kind if kind in ("file", "dir", "symlink", "other") else "other",
        size=as_int(obj.get("size")),
        mode=as_int(obj.get("mode")),
        mtime=as_float(obj.get("mtime")),
        target=target if isinstance(target, str) else None,
    )


def process_info(obj: dict[str, object]) -> ProcessInfo:
    command = obj.get("command")
    name = obj.get("name")
    return ProcessInfo(
        id=str(obj.get("id", "")),
        pid=as_int(obj.get("pid")),
        command=[str(c) for c in command] if isinstance(command, list) else [],
        name=name if isinstance(name, str) else None,
        running=bool(obj.get("running", False)),
        exit_code=opt_int(obj.get("exit_code")),
        started_at=as_float(obj.get("started_at")),
    )
