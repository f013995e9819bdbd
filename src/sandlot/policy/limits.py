"""The largest command, path and environment sandlot accepts, checked before anything parses them.

The policy gate reads every command before it runs (:mod:`sandlot.policy.normalize`), on the
server's behalf, so without a bound one tenant's request can cost the server seconds of CPU
(issue 23: a 781 KiB ``true && true && …`` stalled every tenant). The bounds follow what Linux
would accept anyway, so nothing that could run is refused:

- one argument, and so a command string (it reaches ``execve`` as the argument of ``sh -c``):
  :data:`MAX_ARG_BYTES`, the kernel's ``MAX_ARG_STRLEN`` (128 KiB);
- an argv: :data:`MAX_ARGV_ITEMS` items and :data:`MAX_ARGV_BYTES` in all (a NUL after each,
  as the kernel counts them; Linux allows 2 MiB for argv and environment together, shared);
- a path (``cwd``, ``HOME``, a file operation's ``path``, a path a command writes):
  :data:`MAX_PATH_BYTES`, ``PATH_MAX``, and :data:`MAX_PATH_DEPTH` directories deep (policy
  gets every directory above such a path, so its cost grows with length times depth);
- the environment given with a command: :data:`MAX_ENV_ITEMS` variables (only their names
  reach policy, but every simple command of the string carries them);
- what a command string runs: :data:`MAX_COMMANDS` simple commands (``a; b && c | d`` is 4),
  counted while it is read, and :data:`MAX_WORDS` words and operators; what has more is
  refused as soon as the count is passed, before policy sees any of it.

Sizes are UTF-8 bytes. A request over a bound is :class:`~sandlot.errors.InvalidRequest`
naming the bound. The Manager checks every command it launches (with or without a policy) and
the normalizer checks what it is given, so HTTP, MCP and the SDK all meet the same bounds.
This module imports nothing from sandlot but :mod:`sandlot.errors` and the pure string
reader :mod:`sandlot.policy.shell`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, NoReturn

from sandlot.errors import InvalidRequest
from sandlot.policy.shell import MAX_TOKENS

__all__ = [
    "MAX_ARGV_BYTES",
    "MAX_ARGV_ITEMS",
    "MAX_ARG_BYTES",
    "MAX_COMMANDS",
    "MAX_ENV_ITEMS",
    "MAX_PATH_BYTES",
    "MAX_PATH_DEPTH",
    "MAX_WORDS",
    "check_argv",
    "check_command",
    "check_command_count",
    "check_env",
    "check_path",
    "refuse_words",
]

MAX_ARG_BYTES: Final = 128 * 1024
"""Longest argument, and so longest command string, in bytes (Linux's ``MAX_ARG_STRLEN``)."""
MAX_ARGV_ITEMS: Final = 4096
"""Most items in an argv, the program included."""
MAX_ARGV_BYTES: Final = 256 * 1024
"""Most bytes in an argv, a NUL after each item included."""
MAX_PATH_BYTES: Final = 4096
"""Longest path (Linux's ``PATH_MAX``; a longer one fails with ``ENAMETOOLONG`` anyway)."""
MAX_COMMANDS: Final = 1024
"""Most simple commands one command string may run, as the policy gate reads it."""
MAX_WORDS: Final = MAX_TOKENS
"""Most words and operators in one command string (``a; b`` has 3), each nested string too."""
MAX_PATH_DEPTH: Final = 128
"""Most components in a path (``/a/b`` has 2)."""
MAX_ENV_ITEMS: Final = 128
"""Most environment variables given with one command (the sandbox's own are not counted)."""


def _size(text: str) -> int:
    # A str from JSON may hold a lone surrogate: count it as the 3 bytes it would take rather
    # than fail on it here (it is refused, by name, where it is used).
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _refuse(what: str, size: int, unit: str, limit: int, name: str) -> NoReturn:
    msg = f"{what} is {size} {unit}; the limit is {limit} ({name}, see docs/server.md#limits)"
    raise InvalidRequest(msg, limit=name, maximum=limit, size=size)


def check_argv(argv: Sequence[str]) -> None:
    """Refuse an argv over :data:`MAX_ARGV_ITEMS`, :data:`MAX_ARG_BYTES` or
    :data:`MAX_ARGV_BYTES`, before anything reads it.

    Raises:
        InvalidRequest: naming the limit (``details["limit"]`` is its name).
    """
    if len(argv) > MAX_ARGV_ITEMS:
        _refuse("the argv", len(argv), "items", MAX_ARGV_ITEMS, "MAX_ARGV_ITEMS")
    total = 0
    for item in argv:
        size = _size(item)
        if size > MAX_ARG_BYTES:
            _refuse("an argument", size, "bytes", MAX_ARG_BYTES, "MAX_ARG_BYTES")
        total += size + 1
    if total > MAX_ARGV_BYTES:
        _refuse("the argv", total, "bytes", MAX_ARGV_BYTES, "MAX_ARGV_BYTES")


def check_command(command: str | Sequence[str]) -> None:
    """Refuse a command string over :data:`MAX_ARG_BYTES`, or an argv over its bounds.

    Raises:
        InvalidRequest: naming the limit (``details["limit"]`` is its name).
    """
    if isinstance(command, str):
        size = _size(command)
        if size > MAX_ARG_BYTES:
            _refuse("the command string", size, "bytes", MAX_ARG_BYTES, "MAX_ARG_BYTES")
        return
    check_argv(command)


def check_path(path: str, what: str = "the path") -> None:
    """Refuse a path over :data:`MAX_PATH_BYTES` or :data:`MAX_PATH_DEPTH`.

    Raises:
        InvalidRequest: naming the limit.
    """
    size = _size(path)
    if size > MAX_PATH_BYTES:
        _refuse(what, size, "bytes", MAX_PATH_BYTES, "MAX_PATH_BYTES")
    if path.count("/") <= MAX_PATH_DEPTH:
        return  # the common case: no need to count components
    depth = len([part for part in path.split("/") if part])
    if depth > MAX_PATH_DEPTH:
        _refuse(what, depth, "directories deep", MAX_PATH_DEPTH, "MAX_PATH_DEPTH")


def check_env(env: Mapping[str, str]) -> None:
    """Refuse more than :data:`MAX_ENV_ITEMS` variables, or a value over :data:`MAX_ARG_BYTES`.

    Raises:
        InvalidRequest: naming the limit.
    """
    if len(env) > MAX_ENV_ITEMS:
        _refuse("the environment", len(env), "variables", MAX_ENV_ITEMS, "MAX_ENV_ITEMS")
    for name, value in env.items():
        size = _size(name) + 1 + _size(value)
        if size > MAX_ARG_BYTES:
            _refuse(f"the variable {name[:64]}", size, "bytes", MAX_ARG_BYTES, "MAX_ARG_BYTES")


def check_command_count(count: int) -> None:
    """Refuse a command string once reading it has found over :data:`MAX_COMMANDS` commands.

    Raises:
        InvalidRequest: naming the limit.
    """
    if count > MAX_COMMANDS:
        msg = (
            f"the command string runs more than {MAX_COMMANDS} simple commands "
            "(MAX_COMMANDS, see docs/server.md#limits); run a script file instead"
        )
        raise InvalidRequest(msg, limit="MAX_COMMANDS", maximum=MAX_COMMANDS, size=count)


def refuse_words() -> NoReturn:
    """Refuse a command string with more than :data:`MAX_WORDS` words and operators.

    Raises:
        InvalidRequest: naming the limit.
    """
    msg = (
        f"the command string has more than {MAX_WORDS} words and operators "
        "(MAX_WORDS, see docs/server.md#limits); run a script file instead"
    )
    raise InvalidRequest(msg, limit="MAX_WORDS", maximum=MAX_WORDS)
