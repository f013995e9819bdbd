"""Unwrapping wrapper programs (``env``, ``sudo``, ``nice``, ``timeout``, ``xargs``, ``su``,
``script``…) to the command they run, so policy sees ``rm``, not ``sudo``.

Part of :mod:`sandlot.policy.normalize`. Must not import engines, the store, backends or front
ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from sandlot.policy import shell
from sandlot.policy.parsed import (
    _Arg,
)

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
