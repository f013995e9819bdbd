"""Turning raw operations into :class:`~sandlot.policy.request.PolicyRequest` objects.

The gate is only as good as this module: ``/bin/rm -r -f /``, ``rm -fr //``,
``sudo env rm --recursive --force /.`` and ``bash -lc 'cd / && rm -rf .'`` must all reach policy
as the same command (program ``rm``, flags ``force`` and ``recursive``, path ``/``). So:

- a command (an argv, or a string run with ``sh -c``) becomes the list of simple commands it
  runs: wrappers (``env``, ``sudo``, ``nice``, ``timeout``, ``busybox``...) are unwrapped,
  ``sh -c``/``bash -lc``/``eval`` strings are read with :mod:`sandlot.policy.shell`, ``cd`` is
  followed, flags of the programs in :mod:`sandlot.policy.programs` get canonical names, and
  paths are made absolute and normal;
- what cannot be decided statically (``$X``, ``$(...)``, here-documents, ``source``...) is named
  in ``shell_features`` and sets ``shell_undecidable``, next to the raw string;
- file paths of ``fs.*`` actions are made absolute and normal, with their ancestors listed so a
  Cedar policy can ask "is this under the workdir" with ``context.within.contains(...)``.

The shape of every context is documented in ``docs/policies/README.md``. This module must not
import engines, the store, backends or front ends.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from pydantic import JsonValue, ValidationError

from sandlot.errors import InvalidRequest
from sandlot.models import CommandSpec, NetworkAllowlist, SandboxSpec
from sandlot.policy import limits, shell
from sandlot.policy.programs import ProgramSpec, spec_for
from sandlot.policy.request import ACTIONS, ContextKind, PolicyRequest, Principal, Resource

__all__ = [
    "ancestors",
    "normalize_command",
    "normalize_operation",
    "normalize_path",
]

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


# -- wrappers ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Unwrapped:
    rest: list[_Arg]
    cwd: str | None = None
    shell_source: _Arg | None = None
    env: tuple[str, ...] = ()
    stdin_shell: bool = False
    writes: tuple[_Arg, ...] = ()
    features: frozenset[str] = frozenset()


def _scan(
    args: Sequence[_Arg],
    short_args: str = "",
    long_args: frozenset[str] = frozenset(),
    *,
    short_optional: str = "",
) -> tuple[list[tuple[str, _Arg | None]], int]:
    """Read the leading options of a wrapper; returns them and the index of what follows."""
    opts: list[tuple[str, _Arg | None]] = []
    i = 0
    while i < len(args):
        a = args[i]
        t = a.text
        if t == "--":
            return opts, i + 1
        if not t.startswith("-") or t == "-":
            break
        if t.startswith("--"):
            name, eq, val = t[2:].partition("=")
            if eq:
                opts.append((name, _Arg(val, a.glob, a.literal)))
            elif name in long_args:
                opts.append((name, args[i + 1] if i + 1 < len(args) else None))
                i += 1
            else:
                opts.append((name, None))
            i += 1
            continue
        j = 1
        while j < len(t):
            ch = t[j]
            if ch in short_args:
                attached = t[j + 1 :]
                if attached:
                    opts.append((ch, _Arg(attached, a.glob, a.literal)))
                else:
                    opts.append((ch, args[i + 1] if i + 1 < len(args) else None))
                    i += 1
                break
            if ch in short_optional:
                opts.append((ch, _Arg(t[j + 1 :]) if t[j + 1 :] else None))
                break
            opts.append((ch, None))
            j += 1
        i += 1
    return opts, i


def _opt(opts: list[tuple[str, _Arg | None]], *names: str) -> _Arg | None:
    for name, value in opts:
        if name in names and value is not None:
            return value
    return None


def _has(opts: list[tuple[str, _Arg | None]], *names: str) -> bool:
    return any(name in names for name, _ in opts)


def _is_env_assignment(text: str) -> bool:
    name, eq, _ = text.partition("=")
    return (
        bool(eq)
        and bool(name)
        and (name[0].isalpha() or name[0] == "_")
        and name.replace("_", "a").isalnum()
    )


def _unwrap_env(args: list[_Arg]) -> _Unwrapped | None:
    opts, i = _scan(args, "uCS", frozenset({"unset", "chdir", "split-string"}))
    rest = args[i:]
    if rest and rest[0].text == "-":
        rest = rest[1:]
    names: list[str] = []
    while rest and _is_env_assignment(rest[0].text):
        names.append(rest[0].text.partition("=")[0])
        rest = rest[1:]
    split = _opt(opts, "S", "split-string")
    features: set[str] = set()
    if split is not None:
        # env -S splits the string itself and expands ${VAR} in it: what it runs may be dynamic.
        words, features = shell.split_words(split.text)
        rest = [_Arg.of(w) for w in words] + rest
        while rest and _is_env_assignment(rest[0].text):
            names.append(rest[0].text.partition("=")[0])
            rest = rest[1:]
    cwd = _opt(opts, "C", "chdir")
    return _Unwrapped(
        rest, cwd=cwd.text if cwd else None, env=tuple(names), features=frozenset(features)
    )


def _unwrap_sudo(args: list[_Arg]) -> _Unwrapped | None:
    opts, i = _scan(
        args,
        "ugCDprtTUR",
        frozenset(
            {"user", "group", "close-from", "chdir", "prompt", "role", "type", "command-timeout"}
            | {"other-user", "chroot", "host"}
        ),
    )
    rest = args[i:]
    if _has(opts, "e", "edit"):
        return _Unwrapped([_Arg("sudoedit"), *rest])
    cwd = _opt(opts, "D", "chdir")
    if not rest:
        shell_like = _has(opts, "s", "i", "shell", "login")
        return _Unwrapped([], stdin_shell=shell_like)
    return _Unwrapped(rest, cwd=cwd.text if cwd else None)


def _unwrap_doas(args: list[_Arg]) -> _Unwrapped | None:
    opts, i = _scan(args, "uC")
    rest = args[i:]
    return _Unwrapped(rest, stdin_shell=not rest and _has(opts, "s"))


def _unwrap_nice(args: list[_Arg]) -> _Unwrapped | None:
    if args and args[0].text[:1] == "-" and args[0].text[1:].lstrip("-+").isdigit():
        args = args[1:]
    _, i = _scan(args, "n", frozenset({"adjustment"}))
    return _Unwrapped(args[i:])


def _unwrap_simple(args: list[_Arg]) -> _Unwrapped | None:
    _, i = _scan(args)
    return _Unwrapped(args[i:])


def _unwrap_timeout(args: list[_Arg]) -> _Unwrapped | None:
    _, i = _scan(args, "sk", frozenset({"signal", "kill-after"}))
    return _Unwrapped(args[i + 1 :])  # the duration comes first


def _unwrap_exec(args: list[_Arg]) -> _Unwrapped | None:
    _, i = _scan(args, "a")
    return _Unwrapped(args[i:])


def _unwrap_command(args: list[_Arg]) -> _Unwrapped | None:
    opts, i = _scan(args)
    if _has(opts, "v", "V"):
        return None  # "command -v rm" looks rm up; it runs nothing
    return _Unwrapped(args[i:])


def _unwrap_stdbuf(args: list[_Arg]) -> _Unwrapped | None:
    _, i = _scan(args, "ioe", frozenset({"input", "output", "error"}))
    return _Unwrapped(args[i:])


def _unwrap_ionice(args: list[_Arg]) -> _Unwrapped | None:
    opts, i = _scan(args, "cnpPu", frozenset({"class", "classdata", "pid", "pgid", "uid"}))
    if _has(opts, "p", "P", "u", "pid", "pgid", "uid"):
        return None  # changes another process; runs nothing
    return _Unwrapped(args[i:])


def _unwrap_time(args: list[_Arg]) -> _Unwrapped | None:
    opts, i = _scan(args, "fo", frozenset({"format", "output"}))
    out = _opt(opts, "o", "output")
    return _Unwrapped(args[i:], writes=(out,) if out else ())


def _unwrap_xargs(args: list[_Arg]) -> _Unwrapped | None:
    _, i = _scan(
        args,
        "EIdLnPsa",
        frozenset(
            {"arg-file", "delimiter", "max-args", "max-procs", "max-chars", "process-slot-var"}
        ),
        short_optional="eil",
    )
    rest = args[i:]
    return _Unwrapped(rest or [_Arg("echo")])


def _unwrap_su(args: list[_Arg]) -> _Unwrapped | None:
    # util-linux su permutes its options, so "-c" may follow the user name.
    for k, a in enumerate(args):
        if a.text in ("-c", "--command") and k + 1 < len(args):
            return _Unwrapped([], shell_source=args[k + 1])
        if a.text.startswith("--command="):
            return _Unwrapped([], shell_source=_Arg(a.text.partition("=")[2], a.glob, a.literal))
    return _Unwrapped([], stdin_shell=True)


def _unwrap_script(args: list[_Arg]) -> _Unwrapped | None:
    # util-linux script runs `$SHELL -c CMD`, or without -c an interactive $SHELL fed from
    # its terminal or stdin.
    opts, _ = _scan(
        args,
        "cEIOBTm",
        frozenset(
            {"command", "echo", "log-in", "log-out", "log-io", "log-timing", "logging-format"}
        ),
        short_optional="t",
    )
    command = _opt(opts, "c", "command")
    if command is not None:
        return _Unwrapped([], shell_source=command)
    return _Unwrapped([], stdin_shell=True)


_WRAPPERS: Final[Mapping[str, Callable[[list[_Arg]], _Unwrapped | None]]] = {
    "env": _unwrap_env,
    "sudo": _unwrap_sudo,
    "doas": _unwrap_doas,
    "nice": _unwrap_nice,
    "nohup": _unwrap_simple,
    "setsid": _unwrap_simple,
    "builtin": _unwrap_simple,
    "timeout": _unwrap_timeout,
    "exec": _unwrap_exec,
    "command": _unwrap_command,
    "stdbuf": _unwrap_stdbuf,
    "ionice": _unwrap_ionice,
    "time": _unwrap_time,
    "xargs": _unwrap_xargs,
    "su": _unwrap_su,
    "script": _unwrap_script,
}


# -- programs ----------------------------------------------------------------------------------


def _resolve_long(spec: ProgramSpec, name: str) -> str | None:
    """An exact long option, or the one an unambiguous prefix names (getopt_long accepts those)."""
    if name in spec.long:
        return name
    matches = [n for n in spec.long if n.startswith(name)]
    if name and len({spec.long[m] for m in matches}) == 1:
        return matches[0]
    return None


def _is_mode(text: str) -> bool:
    return len(text) > 1 and all(c in "rwxXstugoa+-=,01234567" for c in text[1:])


def _parse_table(
    spec: ProgramSpec, args: Sequence[_Arg], cmd: _Cmd
) -> tuple[list[_Arg], dict[str, list[_Arg]]]:
    """Split options (canonical names into ``cmd.flags``) from operands, GNU style."""
    operands: list[_Arg] = []
    values: dict[str, list[_Arg]] = {}
    i = 0
    end_of_options = False
    while i < len(args):
        a = args[i]
        t = a.text
        i += 1
        if (
            end_of_options
            or not t.startswith("-")
            or t == "-"
            or (spec.mode_operands and _is_mode(t))
        ):
            operands.append(a)
            cmd.args.append(t)
            continue
        if t == "--":
            end_of_options = True
            cmd.args.append(t)
            continue
        if t.startswith("--"):
            name, eq, val = t[2:].partition("=")
            cmd.args.append(t)
            full = _resolve_long(spec, name)
            if full is None:
                cmd.flags.add(f"--{name}")
                if eq and _pathlike(val):
                    values.setdefault("", []).append(_Arg(val, a.glob, a.literal, a.tilde))
                continue
            canon = spec.long[full]
            cmd.flags.add(canon)
            if full in spec.long_args:
                if eq:
                    values.setdefault(canon, []).append(_Arg(val, a.glob, a.literal, a.tilde))
                elif i < len(args):
                    values.setdefault(canon, []).append(args[i])
                    cmd.args.append(args[i].text)
                    i += 1
            elif eq:
                values.setdefault(canon, []).append(_Arg(val, a.glob, a.literal, a.tilde))
            continue
        j = 1
        while j < len(t):
            ch = t[j]
            short_canon = spec.short.get(ch)
            cmd.args.append(f"-{ch}")
            if short_canon is None:
                cmd.flags.add(f"-{ch}")
                j += 1
                continue
            cmd.flags.add(short_canon)
            if ch in spec.short_args:
                attached = t[j + 1 :]
                if attached:
                    values.setdefault(short_canon, []).append(_Arg(attached, a.glob, a.literal))
                    cmd.args.append(attached)
                elif i < len(args):
                    values.setdefault(short_canon, []).append(args[i])
                    cmd.args.append(args[i].text)
                    i += 1
                break
            if ch in spec.short_optargs:
                attached = t[j + 1 :]
                if attached:
                    values.setdefault(short_canon, []).append(_Arg(attached, a.glob, a.literal))
                    cmd.args.append(attached)
                break
            j += 1
    return operands, values


def _table_command(
    spec: ProgramSpec, args: Sequence[_Arg], cmd: _Cmd, st: _State, cwds: Sequence[str]
) -> None:
    operands, values = _parse_table(spec, args, cmd)
    cmd.operands = [a.text for a in operands]
    path_operands = operands
    if spec.skip_first_unless is not None and not (cmd.flags & spec.skip_first_unless):
        path_operands = operands[1:]
    if spec.operands == "none":
        path_operands = []
    elif spec.operands == "pathlike":
        path_operands = [a for a in path_operands if _pathlike(a.text)]
    writes = spec.writes != "none"
    if spec.writes_if and not (cmd.flags & spec.writes_if):
        writes = False
    if spec.writes_unless and cmd.flags & spec.writes_unless:
        writes = False
    flag_writes = [v for f in spec.write_flags for v in values.get(f, ())]
    last_only = spec.writes == "last" and not flag_writes
    for k, a in enumerate(path_operands):
        is_write = writes and (not last_only or k == len(path_operands) - 1)
        if spec.writes == "last" and flag_writes:
            is_write = False
        st.add_paths(cmd, a, cwds, write=is_write)
    for a in flag_writes:
        st.add_paths(cmd, a, cwds, write=True)
    for f in (*spec.path_flags, ""):
        for a in values.get(f, ()):
            st.add_paths(cmd, a, cwds, write=False)


def _generic_command(args: Sequence[_Arg], cmd: _Cmd, st: _State, cwds: Sequence[str]) -> None:
    """A program we have no table for: flags as written, path-looking operands as paths."""
    end_of_options = False
    for a in args:
        t = a.text
        cmd.args.append(t)
        if not end_of_options and t == "--":
            end_of_options = True
            continue
        if not end_of_options and t.startswith("-") and t != "-":
            name, eq, val = t.partition("=")
            cmd.flags.add(name)
            if eq and _pathlike(val):
                st.add_paths(cmd, _Arg(val, a.glob, a.literal), cwds, write=False)
            continue
        cmd.operands.append(t)
        if _pathlike(t) or (a.tilde and t.startswith("~")):
            st.add_paths(cmd, a, cwds, write=False)


def _dd_command(args: Sequence[_Arg], cmd: _Cmd, st: _State, cwds: Sequence[str]) -> None:
    for a in args:
        cmd.args.append(a.text)
        key, eq, val = a.text.partition("=")
        if not eq:
            cmd.operands.append(a.text)
            continue
        cmd.flags.add(key)
        if key in ("if", "of"):
            st.add_paths(cmd, _Arg(val, a.glob, a.literal), cwds, write=key == "of")


_FIND_START_OPTS: Final = frozenset({"-H", "-L", "-P"})
_FIND_WRITES: Final = frozenset({"-fprint", "-fprint0", "-fls", "-fprintf"})
_FIND_EXEC: Final = frozenset({"-exec", "-execdir", "-ok", "-okdir"})


def _find_command(
    args: list[_Arg], cmd: _Cmd, st: _State, cwds: tuple[str, ...], depth: int
) -> None:
    i = 0
    while i < len(args) and (
        args[i].text in _FIND_START_OPTS or args[i].text.startswith(("-D", "-O"))
    ):
        cmd.args.append(args[i].text)
        if args[i].text == "-D" and i + 1 < len(args):
            i += 1
            cmd.args.append(args[i].text)
        i += 1
    starts: list[_Arg] = []
    while i < len(args) and not args[i].text.startswith(("-", "(", "!", ")", ",")):
        starts.append(args[i])
        cmd.args.append(args[i].text)
        cmd.operands.append(args[i].text)
        i += 1
    if not starts:
        starts = [_Arg(".")]
    deletes = False
    while i < len(args):
        t = args[i].text
        cmd.args.append(t)
        i += 1
        if t == "-delete":
            cmd.flags.add("delete")
            deletes = True
        elif t in _FIND_EXEC:
            cmd.flags.add("exec")
            st.features.add("find_exec")
            sub: list[_Arg] = []
            while i < len(args) and args[i].text not in (";", "+"):
                cmd.args.append(args[i].text)
                if args[i].text != "{}":
                    sub.append(args[i])
                i += 1
            if i < len(args):
                cmd.args.append(args[i].text)
                i += 1
            if sub:
                _run(sub, [], cwds, st, depth, (*cmd.via, "find"), set())
        elif t in _FIND_WRITES and i < len(args):
            cmd.flags.add(t)
            st.add_paths(cmd, args[i], cwds, write=True)
            cmd.args.append(args[i].text)
            i += 1
        elif t.startswith("-"):
            cmd.flags.add(t)
    for a in starts:
        st.add_paths(cmd, a, cwds, write=deletes)


# -- the walk ----------------------------------------------------------------------------------


def _shell_command(
    program: str,
    args: list[_Arg],
    redirects: list[shell.Redirect],
    cwds: tuple[str, ...],
    st: _State,
    depth: int,
    via: tuple[str, ...],
    env: set[str],
) -> _Cmd | None:
    i = 0
    command_mode = stdin_mode = False
    while i < len(args):
        t = args[i].text
        if t in ("--", "-"):
            i += 1
            break
        if t.startswith("--"):
            i += 2 if t in ("--rcfile", "--init-file") else 1
            continue
        if t[:1] in "-+" and len(t) > 1:
            letters = t[1:]
            command_mode = command_mode or "c" in letters
            stdin_mode = stdin_mode or "s" in letters
            i += 1 + letters.count("o") + letters.count("O")
            continue
        break
    rest = args[i:]
    if command_mode:
        if not rest:
            st.features.add("parse_error")
            return None
        _run_source(rest[0], cwds, st, depth, (*via, program))
        return None
    cmd = _Cmd(program=program, argv0=program, via=via, env=env)
    cmd.args = [a.text for a in args]
    if rest and not stdin_mode:
        # The script's contents are not on the command line: `sh x.sh` runs what the gate
        # never sees, as `sh < x.sh` does.
        st.features.add("script_file")
        cmd.operands = [a.text for a in rest]
        st.add_paths(cmd, rest[0], cwds, write=False)
        st.commands.append(cmd)
        return cmd
    # The shell reads its commands from standard input.
    bodies = [r for r in redirects if r.op in ("<<", "<<-", "<<<")]
    if not bodies:
        st.features.add("shell_stdin")
    for r in bodies:
        source = "\n".join(r.body) if r.op != "<<<" else (r.target.text if r.target else "")
        _run_source(_Arg(source), cwds, st, depth, (*via, program))
    st.commands.append(cmd)
    return cmd


def _run_source(
    source: _Arg, cwds: tuple[str, ...], st: _State, depth: int, via: tuple[str, ...]
) -> None:
    st.shell = True
    if depth + 1 > shell.MAX_DEPTH:
        st.features.add("too_deep")
        return
    script = shell.parse(source.text, depth=depth + 1)
    st.features |= script.features
    _walk(script.body, cwds, st, depth + 1, via)


def _cd(args: list[_Arg], cwds: tuple[str, ...], st: _State) -> tuple[str, ...]:
    rest = [a for a in args if a.text not in ("-L", "-P", "-e", "-@", "--")]
    if not rest:
        if st.home is None:
            st.features.add("tilde")
            return cwds
        return (st.home,)
    target = rest[0]
    if target.text == "-":
        st.features.add("cd")
        return cwds
    if not target.literal:
        return cwds
    resolved = st.resolve(target, cwds)
    return tuple(dict.fromkeys(p for p in resolved if p.startswith("/"))) or cwds


def _run(
    args: list[_Arg],
    redirects: list[shell.Redirect],
    cwds: tuple[str, ...],
    st: _State,
    depth: int,
    via: tuple[str, ...],
    env: set[str],
) -> tuple[_Cmd | None, tuple[str, ...] | None]:
    """Record what one argv runs; returns its command record and, for ``cd``, the new cwds."""
    extra_writes: list[_Arg] = []
    env = set(env) | st.env_names
    while args:
        head = args[0]
        program = posixpath.basename(head.text) if head.text != "/" else "/"
        if head.glob:
            st.features.add("glob_command")
        if program == "busybox" and len(args) > 1 and not args[1].text.startswith("-"):
            via = (*via, "busybox")
            args = args[1:]
            continue
        unwrap = _WRAPPERS.get(program) if head.literal else None
        if unwrap is None:
            break
        result = unwrap(args[1:])
        if result is None:
            break
        via = (*via, program)
        if program == "xargs":
            st.features.add("xargs")
        env |= set(result.env)
        st.features |= result.features
        extra_writes.extend(result.writes)
        if result.cwd is not None:
            cwds = tuple(st.resolve(_Arg(result.cwd), cwds)) or cwds
        if result.shell_source is not None:
            _run_source(result.shell_source, cwds, st, depth, via)
            return None, None
        if result.stdin_shell:
            st.features.add("shell_stdin")
        if not result.rest:
            cmd = _Cmd(program=program, argv0=head.text, via=via[:-1], env=env)
            cmd.args = [a.text for a in args[1:]]
            st.commands.append(cmd)
            return cmd, None
        args = result.rest
    if not args:
        return None, None
    head = args[0]
    program = posixpath.basename(head.text) if head.text != "/" else "/"
    rest = args[1:]
    if program in SHELLS:
        return _shell_command(program, rest, redirects, cwds, st, depth, via, env), None
    if program == "eval":
        st.features.add("eval")
        joined = " ".join(a.text for a in rest)
        _run_source(_Arg(joined), cwds, st, depth, (*via, "eval"))
        return None, None
    if program == "trap" and len(rest) >= 2 and rest[0].text not in ("-", "", "-p", "-l"):
        # "trap CMD SIGNAL" runs CMD later (on exit or a signal): read it like eval.
        st.features.add("trap")
        _run_source(rest[0], cwds, st, depth, (*via, "trap"))
    if program == "alias":
        st.features.add("alias")
    cmd = _Cmd(program=program, argv0=head.text, via=via, env=env)
    st.commands.append(cmd)
    for a in extra_writes:
        st.add_paths(cmd, a, cwds, write=True)
    if program in ("source", "."):
        st.features.add("source")
        cmd.args = [a.text for a in rest]
        cmd.operands = list(cmd.args)
        if rest:
            st.add_paths(cmd, rest[0], cwds, write=False)
        return cmd, None
    if program == "cd":
        cmd.args = [a.text for a in rest]
        cmd.operands = list(cmd.args)
        return cmd, _cd(rest, cwds, st)
    if program == "find":
        _find_command(rest, cmd, st, cwds, depth)
        return cmd, None
    if program == "dd":
        _dd_command(rest, cmd, st, cwds)
        return cmd, None
    if _is_interpreter(program) and _code_not_in_request(program, rest):
        st.features.add("interpreter")
    spec = spec_for(program)
    if spec is not None:
        _table_command(spec, rest, cmd, st, cwds)
    else:
        _generic_command(rest, cmd, st, cwds)
    return cmd, None


def _redirect_paths(
    cmd: _Cmd, redirects: list[shell.Redirect], cwds: tuple[str, ...], st: _State
) -> None:
    for r in redirects:
        target = r.target
        if target is None or r.op in ("<<", "<<-", "<<<"):
            continue
        if r.op in ("<&", ">&") and (
            target.text.isdigit() or target.text.rstrip("-").isdigit() or target.text == "-"
        ):
            continue  # duplicating or closing a file descriptor names no file
        st.add_paths(cmd, _Arg.of(target), cwds, write=r.op in shell.WRITE_OPS)


def _walk(
    body: Sequence[shell.SimpleCommand | shell.Subshell],
    cwds: tuple[str, ...],
    st: _State,
    depth: int,
    via: tuple[str, ...],
) -> None:
    for node in body:
        limits.check_command_count(len(st.commands))
        if isinstance(node, shell.Subshell):
            _walk(node.body, cwds, st, depth, via)
            continue
        words: list[_Arg] = []
        for w in node.words:
            if "{" in w.text and st.brace_words >= _BRACE_WORDS:
                # Past the budget a word is kept as written: what it names is then unknown.
                st.features.add("too_complex")
                words.append(_Arg.of(w))
            elif "{" in w.text:
                expanded = shell.expand_braces(w)
                if len(expanded) > 1:
                    st.features.add("brace")
                    st.brace_words += len(expanded)
                words.extend(_Arg.of(x) for x in expanded)
            else:
                words.append(_Arg.of(w))
        env = {a.text.partition("=")[0].removesuffix("+") for a in node.assignments}
        cmd, new_cwds = _run(words, node.redirects, cwds, st, depth, via, env)
        if node.redirects:
            if cmd is None:
                cmd = _Cmd(program="", argv0="", via=via, env=env | st.env_names)
                st.commands.append(cmd)
            _redirect_paths(cmd, node.redirects, cwds, st)
        if new_cwds is not None:
            # After "cd X && ..." we are in X; after "cd X; ..." cd may have failed, so either.
            if node.sep == "&&":
                cwds = new_cwds
            elif node.sep not in ("|", "|&"):
                cwds = tuple(dict.fromkeys((*cwds, *new_cwds)))


def normalize_command(
    command: str | Sequence[str] | CommandSpec,
    *,
    cwd: str = "/",
    env: Mapping[str, str] | None = None,
    home: str | None = None,
) -> dict[str, JsonValue]:
    """The normalized context of a command (the context of ``exec``, ``process.start``...).

    Args:
        command: A string (run with ``sh -c``, as the Manager does), an exact argv, or a
            :class:`~sandlot.models.CommandSpec` (its ``cwd`` and ``env`` win over the
            arguments below).
        cwd: The absolute directory the command starts in.
        env: Environment variables set for the command (only their names reach policy; ``HOME``
            also resolves ``~``).
        home: The home directory for ``~`` when ``env`` has no ``HOME``; unknown means ``~``
            is undecidable.

    Returns:
        The context documented in ``docs/policies/README.md``: ``commands`` (each with
        ``program``, ``args``, ``flags``, ``paths``, ``writes``...), ``programs``, ``shell``,
        ``shell_undecidable``, ``shell_features``, ``raw``, ``argv``, ``cwd``, ``env``.

    Raises:
        InvalidRequest: an empty argv, a relative ``cwd``, a NUL byte, or a command, path or
            environment over a bound of :mod:`sandlot.policy.limits` (checked before any
            parsing).
    """
    env = dict(env or {})
    if isinstance(command, CommandSpec):
        cwd = command.cwd or cwd
        env |= command.env
        command = command.argv()
    limits.check_command(command)
    limits.check_env(env)
    limits.check_path(cwd, "cwd")
    if not cwd.startswith("/"):
        msg = f"cwd must be an absolute path, got {cwd!r}"
        raise InvalidRequest(msg)
    cwd = normalize_path(cwd)
    home = env.get("HOME", home)
    if home is not None:
        limits.check_path(home, "HOME")
        home = normalize_path(home, cwd)
    st = _State(home=home, env_names=frozenset(env))
    if isinstance(command, str):
        if "\x00" in command:
            msg = "a command must not contain NUL bytes"
            raise InvalidRequest(msg)
        argv = ["sh", "-c", command]
        raw = command
    else:
        argv = [str(a) for a in command]
        if not argv:
            msg = "a command needs at least a program"
            raise InvalidRequest(msg)
        if any("\x00" in a for a in argv):
            msg = "a command must not contain NUL bytes"
            raise InvalidRequest(msg)
        raw = shlex.join(argv)
    try:
        _run([_Arg.plain(a) for a in argv], [], (cwd,), st, 0, (), set())
    except InvalidRequest:
        raise
    except shell.TooManyTokens:
        limits.refuse_words()
    except Exception as e:
        # A command the gate cannot read is refused, never waved through.
        msg = f"the policy gate could not read this command ({type(e).__name__}: {e})"
        raise InvalidRequest(msg) from e
    limits.check_command_count(len(st.commands))
    commands = [c.to_json() for c in st.commands]
    programs = {c.program for c in st.commands} | {v for c in st.commands for v in c.via}
    return {
        "argv": _jl(argv),
        "raw": raw,
        "cwd": cwd,
        "env": _jl(sorted(env)),
        "shell": st.shell,
        "shell_undecidable": not st.features.isdisjoint(shell.UNDECIDABLE_FEATURES),
        "shell_features": _jl(sorted(st.features)),
        "programs": _jl(sorted(programs)),
        "commands": list[JsonValue](commands),
    }


# -- operations --------------------------------------------------------------------------------


def _path_context(args: Mapping[str, object], *, mode: bool) -> dict[str, JsonValue]:
    path = args.get("path")
    if isinstance(path, str):
        limits.check_path(path)
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        msg = f"path must be an absolute path, got {path!r}"
        raise InvalidRequest(msg)
    normal = normalize_path(path)
    ctx: dict[str, JsonValue] = {
        "path": normal,
        "within": _jl(ancestors(normal)),
        "recursive": bool(args.get("recursive", False)),
        # The test a command's device_writes uses, so a rule on raw devices reads the same
        # for `> /dev/sda` and for a file-API write of /dev/sda (and /dev/null is neither).
        "device": _is_device(normal),
    }
    if mode:
        value = args.get("mode")
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0o7777:
            msg = f"mode must be an integer in 0..0o7777, got {value!r}"
            raise InvalidRequest(msg)
        ctx["mode"] = value
    return ctx


def _int(args: Mapping[str, object], name: str, default: int | None = None) -> int:
    value = args.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        msg = f"{name} must be an integer, got {value!r}"
        raise InvalidRequest(msg)
    return value


def _str(args: Mapping[str, object], name: str, default: str = "") -> str:
    value = args.get(name, default)
    if value is None:
        return default
    if not isinstance(value, str):
        msg = f"{name} must be a string, got {value!r}"
        raise InvalidRequest(msg)
    return value


def _network_context(value: object) -> dict[str, JsonValue]:
    if value in ("allow-all", "deny-all"):
        return {"network": str(value), "allow_domains": [], "allow_cidrs": [], "deny_cidrs": []}
    try:
        allow = (
            value if isinstance(value, NetworkAllowlist) else NetworkAllowlist.model_validate(value)
        )
    except ValidationError:
        msg = f"network must be 'allow-all', 'deny-all' or an allowlist, got {value!r}"
        raise InvalidRequest(msg) from None
    return {
        "network": "allowlist",
        "allow_domains": _jl(sorted(allow.allow_domains)),
        "allow_cidrs": _jl(sorted(allow.allow_cidrs)),
        "deny_cidrs": _jl(sorted(allow.deny_cidrs)),
    }


def _create_context(args: Mapping[str, object]) -> dict[str, JsonValue]:
    spec = args.get("spec", SandboxSpec())
    if not isinstance(spec, SandboxSpec):
        try:
            spec = SandboxSpec.model_validate(spec)
        except ValidationError as e:
            msg = f"invalid SandboxSpec: {e.errors()[0]['msg']}"
            raise InvalidRequest(msg) from None
    res = spec.resources
    ctx: dict[str, JsonValue] = {
        "image": spec.image or "",
        "workdir": spec.workdir,
        "ports": _jl(sorted(spec.ports)),
        "vcpus_milli": round(res.vcpus * 1000) if res.vcpus else 0,
        "memory_mb": res.memory_mb or 0,
        "pids": res.pids or 0,
        "disk_mb": res.disk_mb or 0,
        "timeout_s": round(spec.timeout) if spec.timeout else 0,
        "idle_timeout_s": round(spec.idle_timeout) if spec.idle_timeout else 0,
        "git_url": spec.git.url if spec.git else "",
        "env": _jl(sorted(spec.env)),
        "has_setup": bool(spec.setup_steps()),
        "has_start": spec.start is not None,
    }
    ctx |= _network_context(spec.network)
    return ctx


def normalize_operation(
    action: str,
    *,
    principal: Principal,
    resource: Resource,
    args: Mapping[str, object] | None = None,
) -> PolicyRequest:
    """Build the normalized request for one operation.

    Args:
        action: A name from :data:`~sandlot.policy.request.ACTIONS` (``"exec"``, ``"fs.write"``...).
        principal: Who asks.
        resource: The sandbox (for ``sandbox.create``, :meth:`Resource.for_spec`).
        args: The operation's arguments, by action kind:

            - ``exec``, ``process.start``, ``pty.open``: ``command`` (str, argv list or
              ``CommandSpec``), optional ``cwd`` (default: the sandbox's workdir), ``env``, ``home``;
            - ``fs.*``: ``path`` (absolute), optional ``recursive``; ``fs.chmod`` also ``mode``;
            - ``port.expose``: ``port``; ``process.signal``: ``process_id``, ``signal``;
            - ``network.update``: ``network`` (``"allow-all"``, ``"deny-all"`` or an allowlist);
            - ``sandbox.create``: ``spec`` (a ``SandboxSpec`` or its dict);
            - ``snapshot``, ``restore``, ``fork``: optional ``snapshot_id``, ``count`` (fork);
            - ``stop``, ``resume``, ``destroy``: nothing.

    Returns:
        The request every engine decides on.

    Raises:
        InvalidRequest: an unknown action or malformed arguments.
    """
    info = ACTIONS.get(action)
    if info is None:
        msg = f"unknown action {action!r}; known: {', '.join(sorted(ACTIONS))}"
        raise InvalidRequest(msg)
    args = args or {}
    kind = info.kind
    context: dict[str, JsonValue]
    if kind is ContextKind.COMMAND:
        command = args.get("command")
        if command is None and action == "pty.open":
            command = ["sh"]
        if not isinstance(command, (str, list, tuple, CommandSpec)):
            msg = f"command must be a string, an argv list or a CommandSpec, got {command!r}"
            raise InvalidRequest(msg)
        env = args.get("env")
        if env is not None and not (
            isinstance(env, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            msg = "env must map names to strings"
            raise InvalidRequest(msg)
        home = args.get("home")
        context = normalize_command(
            command if isinstance(command, (str, CommandSpec)) else [str(a) for a in command],
            cwd=_str(args, "cwd", resource.workdir) or resource.workdir,
            env=env,
            home=home if isinstance(home, str) else None,
        )
        if action == "pty.open":
            # What is typed into a terminal never reaches the gate, whatever program reads it.
            features = context["shell_features"]
            assert isinstance(features, list)
            context["shell_features"] = _jl(sorted({*map(str, features), "terminal"}))
            context["shell_undecidable"] = True
    elif kind is ContextKind.PATH:
        context = _path_context(args, mode=False)
    elif kind is ContextKind.CHMOD:
        context = _path_context(args, mode=True)
    elif kind is ContextKind.PORT:
        port = _int(args, "port")
        if not 1 <= port <= 65535:
            msg = f"port {port} is outside 1..65535"
            raise InvalidRequest(msg)
        context = {"port": port}
    elif kind is ContextKind.SIGNAL:
        context = {"process_id": _str(args, "process_id"), "signal": _int(args, "signal", 15)}
    elif kind is ContextKind.NETWORK:
        context = _network_context(args.get("network"))
    elif kind is ContextKind.CREATE:
        context = _create_context(args)
    elif kind is ContextKind.SNAPSHOT:
        context = {"snapshot_id": _str(args, "snapshot_id"), "count": _int(args, "count", 1)}
    else:
        context = {}
    return PolicyRequest.model_construct(
        principal=principal, action=action, resource=resource, context=context
    )
