"""The agent wire protocol, host side: frame codec, constants, error codes, the agent's command line.

``docs/agent-protocol.md`` is the specification; this module and :mod:`sandlot.channel.agent`
are its two implementations. The agent must stay a single stdlib-only file that can be copied
alone into an image, so it cannot import this module; instead this module re-states the
constants and a unit test (``tests/unit/channel/test_protocol.py``) asserts that both sides
agree. This module imports only :mod:`sandlot.errors` and the standard library.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from sandlot.errors import BackendError, SandboxError, error_from_code

__all__ = [
    "AGENT_PATH",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_DATA",
    "MAX_PAYLOAD",
    "PROTOCOL_VERSION",
    "WINDOW",
    "AgentInfo",
    "Chan",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "ProtocolError",
    "agent_argv",
    "decode_json",
    "decode_window",
    "encode_frame",
    "encode_json",
    "encode_window",
    "error_from_reply",
    "parse_hello",
    "prepare_agent",
]

PROTOCOL_VERSION: Final = 1
"""The protocol version this client speaks (offered in its HELLO)."""

MAGIC: Final = b"\x89SANDLOT"
"""Sent by each side before its first frame; lets a reader skip stale bytes on a device."""

HEADER: Final = struct.Struct(">IBBI")
HEADER_SIZE: Final = 10
"""``length:u32 type:u8 chan:u8 stream:u32``, big-endian, then ``length`` payload bytes."""

MAX_PAYLOAD: Final = 16 << 20
"""The largest frame payload either side accepts."""

MAX_DATA: Final = 1 << 20
"""The largest DATA payload a sender produces."""

WINDOW: Final = 4 << 20
"""Per-stream receive window this client grants (announced in its HELLO)."""

_U32: Final = struct.Struct(">I")

AGENT_PATH: Final = Path(__file__).with_name("agent.py")
"""The agent program, to copy or bind-mount into a sandbox."""


class FrameType(enum.IntEnum):
    """Frame types (the ``type`` byte)."""

    HELLO = 1
    OPEN = 2
    DATA = 3
    EOF = 4
    EVENT = 5
    END = 6
    WINDOW = 7
    CANCEL = 8
    PING = 9
    PONG = 10
    ERROR = 11


class Chan(enum.IntEnum):
    """Sub-channels of a stream's DATA and EOF frames (the ``chan`` byte)."""

    IN = 0
    OUT = 1
    ERR = 2


class Frame(NamedTuple):
    """One decoded frame."""

    type: int
    chan: int
    stream: int
    payload: bytes


class ProtocolError(BackendError):
    """The peer broke the framing (the connection cannot be used any more)."""


def encode_frame(
    ftype: int, stream: int, payload: bytes | memoryview = b"", chan: int = 0
) -> bytes:
    """One frame as bytes.

    Raises:
        ProtocolError: when the payload is over :data:`MAX_PAYLOAD`.
    """
    if len(payload) > MAX_PAYLOAD:
        msg = f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}"
        raise ProtocolError(msg)
    return HEADER.pack(len(payload), ftype, chan, stream) + payload


def encode_window(increment: int) -> bytes:
    """The payload of a WINDOW frame."""
    return _U32.pack(increment)


def decode_window(payload: bytes) -> int:
    """The credit increment carried by a WINDOW frame."""
    if len(payload) != 4:
        msg = f"WINDOW payload must be 4 bytes, got {len(payload)}"
        raise ProtocolError(msg)
    return int(_U32.unpack(payload)[0])


def encode_json(obj: object) -> bytes:
    """Compact ASCII JSON (non-ASCII and lone surrogates are escaped, so any str survives)."""
    return json.dumps(obj, separators=(",", ":")).encode("ascii")


def decode_json(payload: bytes) -> object:
    """Parse a JSON payload.

    Raises:
        ProtocolError: when it is not valid UTF-8 JSON.
    """
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        msg = f"malformed JSON from the agent: {e}"
        raise ProtocolError(msg) from None


class FrameDecoder:
    """Incremental decoder: feed received bytes, get whole frames.

    Bytes before the peer's :data:`MAGIC` are skipped (stale output left on a device by an
    earlier session). Buffers are joined only once a whole frame is present, so a 1 MiB frame
    arriving in many small reads is copied once.
    """

    def __init__(self, *, expect_magic: bool = True) -> None:
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._synced = not expect_magic
        self._need = len(MAGIC) if expect_magic else HEADER_SIZE

    def feed(self, data: bytes) -> list[Frame]:
        """Add received bytes; return the frames they complete.

        Raises:
            ProtocolError: on a frame longer than :data:`MAX_PAYLOAD`.
        """
        self._pending.append(data)
        self._pending_len += len(data)
        if self._pending_len < self._need:
            return []
        buf = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        self._pending_len = 0
        off = 0
        if not self._synced:
            i = buf.find(MAGIC)
            if i < 0:
                tail = buf[-(len(MAGIC) - 1) :]
                self._pending = [tail]
                self._pending_len = len(tail)
                return []
            self._synced = True
            off = i + len(MAGIC)
        frames: list[Frame] = []
        n = len(buf)
        mv = memoryview(buf)
        while True:
            if n - off < HEADER_SIZE:
                self._need = HEADER_SIZE
                break
            if buf.startswith(MAGIC, off):
                # The peer began a new session (an agent on a device answers each HELLO it
                # reads): no header starts so (its length would be over 2 GiB), so skip it.
                off += len(MAGIC)
                continue
            length, ftype, chan, stream = HEADER.unpack_from(buf, off)
            if length > MAX_PAYLOAD:
                msg = f"frame of {length} bytes exceeds the {MAX_PAYLOAD}-byte limit"
                raise ProtocolError(msg)
            end = off + HEADER_SIZE + length
            if end > n:
                self._need = HEADER_SIZE + length
                break
            frames.append(Frame(ftype, chan, stream, bytes(mv[off + HEADER_SIZE : end])))
            off = end
        if off < n:
            rest = buf[off:]
            self._pending = [rest]
            self._pending_len = len(rest)
        return frames


@dataclass(frozen=True)
class AgentInfo:
    """What the agent said about itself in its HELLO."""

    protocol: int
    """The protocol version in use."""
    version: str
    """The agent program's version."""
    pid: int
    """The agent's pid (inside the sandbox)."""
    pid1: bool
    """True when the agent is PID 1 of its pid namespace."""
    python: str
    """The interpreter running the agent."""
    boot_id: str
    """Random per agent start; ids of processes and terminals embed it."""
    workdir: str
    """The default working directory of commands."""
    window: int
    """The agent's per-stream receive window (our initial send credit)."""
    max_data: int
    """The largest DATA payload the agent wants."""
    ops: tuple[str, ...]
    """The operations it serves."""


def parse_hello(obj: object) -> AgentInfo:
    """Validate the agent's HELLO payload.

    Raises:
        ProtocolError: when a field is missing or of the wrong type.
    """
    if not isinstance(obj, dict):
        msg = "HELLO is not a JSON object"
        raise ProtocolError(msg)
    try:
        ops = obj.get("ops") or []
        return AgentInfo(
            protocol=int(obj["protocol"]),
            version=str(obj.get("version", "")),
            pid=int(obj.get("pid", 0)),
            pid1=bool(obj.get("pid1", False)),
            python=str(obj.get("python", "")),
            boot_id=str(obj.get("boot_id", "")),
            workdir=str(obj.get("workdir", "/")),
            window=int(obj.get("window", 64 << 10)),
            max_data=min(int(obj.get("max_data", MAX_DATA)), MAX_DATA),
            ops=tuple(str(o) for o in ops),
        )
    except (KeyError, TypeError, ValueError) as e:
        msg = f"malformed HELLO from the agent: {e}"
        raise ProtocolError(msg) from None


def error_from_reply(error: object) -> SandboxError:
    """The sandlot error an END ``{"ok": false, "error": ...}`` stands for."""
    if not isinstance(error, dict):
        return BackendError(f"malformed error reply from the agent: {error!r}")
    code = error.get("code")
    message = error.get("message")
    details = error.get("details")
    return error_from_code(
        code if isinstance(code, str) else "backend_error",
        message if isinstance(message, str) else "the agent reported an error",
        details if isinstance(details, dict) else None,
    )


def agent_argv(
    mode: Sequence[str],
    *,
    python: str = "python3",
    agent_path: str | Path = AGENT_PATH,
    workdir: str | None = None,
    env_file: str | None = None,
    quiet: bool = False,
) -> list[str]:
    """The command line that starts the agent.

    Args:
        mode: one of ``["--listen-fd", "3"]``, ``["--listen", PATH]``, ``["--device", PATH]``,
            ``["--stdio"]``.
        python: the interpreter inside the sandbox.
        agent_path: where the agent file is inside the sandbox.
        workdir: default working directory of commands.
        env_file: a JSON object file of default environment variables.
        quiet: silence the agent's own log lines.
    """
    argv = [python, "-I", "-S", str(agent_path), *mode]
    if workdir is not None:
        argv += ["--workdir", workdir]
    if env_file is not None:
        argv += ["--env-file", env_file]
    if quiet:
        argv.append("--quiet")
    return argv


_COMPILE = (
    "import py_compile, sys; "
    "py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True, "
    "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)"
)
_prepared: dict[tuple[str, str], Path] = {}


def _run_python(python: str, *args: str) -> str:
    from sandlot.errors import BackendUnavailable

    try:
        proc = subprocess.run(
            [python, "-I", "-S", *args], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        msg = f"cannot run {python} for the sandbox agent: {e}"
        raise BackendUnavailable(msg) from e
    if proc.returncode != 0:
        msg = f"{python} failed preparing the sandbox agent: {proc.stderr.strip()[-500:]}"
        raise BackendUnavailable(msg)
    return proc.stdout.strip()


def prepare_agent(python: str = "python3", cache_dir: str | Path | None = None) -> Path:
    """The agent compiled to bytecode for ``python``: run that file instead of ``agent.py``.

    A script run as ``python3 agent.py`` is compiled on every start (about 45 ms for the
    agent); ``python3 -I -S agent.pyc`` skips that, which is most of the agent's start-up time.
    Bytecode is specific to the interpreter's version, so compile with the interpreter that runs
    the agent inside the sandbox (or one of the same major.minor). The file is cached under
    ``cache_dir`` (default ``sandlot.config.cache_dir() / "agent"``), keyed by the agent's source
    hash and the interpreter's cache tag (``cpython-311``), and remembered per process.

    Raises:
        BackendUnavailable: the interpreter cannot be run or cannot compile the agent.
    """
    from sandlot.config import cache_dir as default_cache

    base = Path(cache_dir) if cache_dir is not None else default_cache() / "agent"
    digest = hashlib.sha256(AGENT_PATH.read_bytes()).hexdigest()[:16]
    key = (python, f"{base}/{digest}")
    known = _prepared.get(key)
    if known is not None and known.exists():
        return known
    tag = _run_python(python, "-c", "import sys; sys.stdout.write(sys.implementation.cache_tag)")
    final = base / f"agent-{digest}-{tag}.pyc"
    if not final.exists():
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / f".agent-{digest}-{tag}-{os.getpid()}.tmp"
        try:
            _run_python(python, "-c", _COMPILE, str(AGENT_PATH), str(tmp))
            # Renamed into place: concurrent callers never see a half-written file.
            tmp.replace(final)
        finally:
            tmp.unlink(missing_ok=True)
    _prepared[key] = final
    return final
