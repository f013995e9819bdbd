"""What the normalizer reads a command into: its words, its simple commands, the walk's
state; the program families it knows (shells, interpreters); lexical path normalization.

Part of :mod:`sandlot.policy.normalize`. Must not import engines, the store, backends or front
ends.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from pydantic import JsonValue

from sandlot.policy import limits, shell

SHELLS: Final = frozenset(
    {
        "sh",
        "bash",
        "dash",
        "zsh",
        "ksh",
        "mksh",
        "ash",
        "rbash",
        "lksh",
        "pdksh",
        "yash",
        "posh",
        "fish",
    }
)
INTERPRETERS: Final = frozenset(
    {
        "python",
        "python2",
        "python3",
        "pypy",
        "pypy3",
        "ipython",
        "ipython3",
        "perl",
        "ruby",
        "irb",
        "node",
        "nodejs",
        "deno",
        "bun",
        "php",
        "lua",
        "luajit",
        "tclsh",
        "wish",
        "Rscript",
        "osh",
        "elvish",
        "nu",
        "pwsh",
        "expect",
    }
)
"""Programs that run code from a script file, a module, stdin or their terminal: code that is
not in the request (``python3.12`` and the like count too)."""
_INTERPRETER_VERSIONED: Final = re.compile(r"(python|pypy|lua|perl|ruby|php)[0-9][0-9.]*")
_INLINE_CODE_FLAGS: Final[Mapping[str, frozenset[str]]] = {
    "python": frozenset({"-c"}),
    "pypy": frozenset({"-c"}),
    "perl": frozenset({"-e", "-E"}),
    "ruby": frozenset({"-e"}),
    "node": frozenset({"-e", "-p", "--eval", "--print"}),
    "nodejs": frozenset({"-e", "-p", "--eval", "--print"}),
    "php": frozenset({"-r"}),
}
"""Options that give an interpreter its whole program on the command line: that code is in the
request (``raw``), where a policy can read it, so it is not undecidable in the sense above."""
_INFO_ONLY_ARGS: Final = frozenset({"--version", "-V", "--help", "-h"})
_STREAM_DEVICES: Final = frozenset(
    {
        "/dev/null",
        "/dev/zero",
        "/dev/full",
        "/dev/random",
        "/dev/urandom",
        "/dev/tty",
        "/dev/stdin",
        "/dev/stdout",
        "/dev/stderr",
        "/dev/console",
        "/dev/ptmx",
    }
)
_STREAM_PREFIXES: Final = ("/dev/fd/", "/dev/pts/")
_NOT_DEVICE_PREFIXES: Final = ("/dev/shm/", "/dev/mqueue/")
_NOT_DEVICE_DIRS: Final = frozenset({"/dev/shm", "/dev/mqueue", "/dev/fd", "/dev/pts"})
_BRACE_WORDS: Final = 4096
"""Words brace expansion may produce in one command string (each word may give 256): past it
the string is ``too_complex``, so ``echo {a,b}{c,d}…`` repeated cannot multiply the gate's work."""


def normalize_path(path: str, cwd: str = "/") -> str:
    """An absolute, normal path: ``..``, ``.``, and repeated slashes resolved lexically.

    Args:
        path: Absolute, or relative to ``cwd``.
        cwd: The absolute directory relative paths start from.

    Returns:
        The path; ``//``, ``/.`` and ``/..`` all become ``/``. Symlinks are not resolved (the
        gate cannot see the sandbox's filesystem); the in-sandbox agent resolves them inside.
    """
    if not path.startswith("/"):
        path = f"{cwd}/{path}"
    out = posixpath.normpath(path)
    # POSIX lets "//" mean something special, so normpath keeps it; Linux does not.
    if out.startswith("//"):
        out = "/" + out.lstrip("/")
    return out


def ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["/", "/a", "/a/b"]``: the path and every directory above it.

    Raises:
        InvalidRequest: a path over :data:`~sandlot.policy.limits.MAX_PATH_BYTES` or
            :data:`~sandlot.policy.limits.MAX_PATH_DEPTH` (the list grows with both).
    """
    limits.check_path(path, f"the path {path[:40]!r}…" if len(path) > 40 else f"the path {path!r}")
    if path == "/":
        return ["/"]
    out = ["/"]
    acc = ""
    for part in path.strip("/").split("/"):
        acc = f"{acc}/{part}"
        out.append(acc)
    return out


def _common_within(paths: Iterable[str]) -> list[str]:
    """The directories every one of ``paths`` is within (empty when there are no paths)."""
    absolute = [p for p in paths if p.startswith("/")]
    if not absolute:
        return []
    return (
        ancestors(posixpath.commonpath(absolute)) if len(absolute) > 1 else ancestors(absolute[0])
    )


def _jl(items: Iterable[str] | Iterable[int]) -> list[JsonValue]:
    """A JSON list (lists are invariant, so ``list[str]`` is not a ``list[JsonValue]``)."""
    return list(items)


def _is_stream(path: str) -> bool:
    return path in _STREAM_DEVICES or path.startswith(_STREAM_PREFIXES)


def _is_device(path: str) -> bool:
    return (
        path.startswith("/dev/")
        and not _is_stream(path)
        and path not in _NOT_DEVICE_DIRS
        and not path.startswith(_NOT_DEVICE_PREFIXES)
    )


def _glob_dir(pattern: str) -> str:
    """The directory whose entries a normalized glob pattern names: ``/usr/*`` -> ``/usr``."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            head = "/".join(parts[:i])
            return head or "/"
    return pattern


@dataclass(slots=True)
class _Arg:
    text: str
    glob: bool = False
    literal: bool = True
    tilde: bool = False

    @classmethod
    def plain(cls, text: str) -> _Arg:
        # An exact argv is never expanded, but a glob character in it is still reported: a
        # pattern such as "/*" is treated as naming what it would match (fails safe).
        return cls(text, glob=any(c in text for c in "*?["))

    @classmethod
    def of(cls, word: shell.Word) -> _Arg:
        return cls(word.text, glob=word.glob, literal=word.literal, tilde=word.tilde)


@dataclass(slots=True)
class _Cmd:
    program: str
    argv0: str
    via: tuple[str, ...]
    env: set[str]
    args: list[str] = field(default_factory=list)
    flags: set[str] = field(default_factory=set)
    operands: list[str] = field(default_factory=list)
    paths: set[str] = field(default_factory=set)
    glob_dirs: set[str] = field(default_factory=set)
    writes: set[str] = field(default_factory=set)

    def to_json(self) -> dict[str, JsonValue]:
        return {
            "program": self.program,
            "argv0": self.argv0,
            "args": _jl(self.args),
            "flags": _jl(sorted(self.flags)),
            "operands": _jl(self.operands),
            "paths": _jl(sorted(self.paths)),
            "glob_dirs": _jl(sorted(self.glob_dirs)),
            "writes": _jl(sorted(self.writes)),
            "writes_within": _jl(_common_within(self.writes)),
            "devices": _jl(sorted(p for p in self.paths if _is_device(p))),
            "device_writes": _jl(sorted(p for p in self.writes if _is_device(p))),
            "via": _jl(self.via),
            "env": _jl(sorted(self.env)),
        }


@dataclass(slots=True)
class _State:
    home: str | None
    env_names: frozenset[str]
    features: set[str] = field(default_factory=set)
    commands: list[_Cmd] = field(default_factory=list)
    shell: bool = False
    brace_words: int = 0

    def resolve(self, arg: _Arg, cwds: Sequence[str]) -> list[str]:
        """Absolute normal paths an argument names (one per possible working directory)."""
        text = arg.text
        if not text or text == "-":
            return []
        if arg.tilde and text.startswith("~"):
            user, sep, rest = text[1:].partition("/")
            if user or self.home is None:
                # ~user, or a home we were not told: the path is not knowable here.
                self.features.add("tilde")
                return [text]
            text = self.home + sep + rest
        if text.startswith("/"):
            return [normalize_path(text)]
        return [normalize_path(text, cwd) for cwd in cwds]

    def add_paths(self, cmd: _Cmd, arg: _Arg, cwds: Sequence[str], *, write: bool) -> None:
        for p in self.resolve(arg, cwds):
            cmd.paths.add(p)
            if arg.glob:
                cmd.glob_dirs.add(_glob_dir(p))
            if write and not _is_stream(p):
                cmd.writes.add(p)


def _is_interpreter(program: str) -> bool:
    return program in INTERPRETERS or _INTERPRETER_VERSIONED.fullmatch(program) is not None


def _code_not_in_request(program: str, args: Sequence[_Arg]) -> bool:
    """Whether an interpreter runs code from a file, a module, stdin or a terminal.

    Only an exact inline-code option (``python3 -c CODE``, ``perl -e CODE``, ``node -e CODE``)
    before any operand, or a lone ``--version``/``--help``, says otherwise; anything this does
    not understand (an attached ``-cCODE``, an option taking a value) counts as code unseen.
    """
    if args and all(a.text in _INFO_ONLY_ARGS for a in args):
        return False
    family = _INTERPRETER_VERSIONED.sub(r"\1", program)
    inline = _INLINE_CODE_FLAGS.get(family, frozenset())
    for a in args:
        if a.text in inline:
            return False
        if not a.text.startswith("-") or a.text in ("-", "--", "-m", "-i"):
            return True  # a script file, stdin ("-"), a module's file, or interactive after
    return True


def _pathlike(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~")) or text in (".", "..")
