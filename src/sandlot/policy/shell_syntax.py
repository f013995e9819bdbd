"""The shell reader's vocabulary: operators and limits, the features that make a command
undecidable, and the nodes it produces (:class:`Word`, :class:`Redirect`,
:class:`SimpleCommand`, :class:`Subshell`, :class:`Script`).

Part of :mod:`sandlot.policy.shell` (import the names from there). Imports nothing from
sandlot: it is pure string processing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

UNDECIDABLE_FEATURES: Final = frozenset(
    {
        "alias",
        "arithmetic",
        "backtick",
        "case",
        "cd",
        "command_substitution",
        "eval",
        "find_exec",
        "function",
        "glob_command",
        "heredoc",
        "interpreter",
        "parse_error",
        "process_substitution",
        "script_file",
        "shell_stdin",
        "source",
        "terminal",
        "tilde",
        "too_complex",
        "too_deep",
        "trap",
        "variable",
        "xargs",
    }
)
"""Features whose presence makes a command string undecidable: what runs, or on what, depends
on state only the running shell knows. ``glob`` and ``brace`` are recorded but are not in this
set: brace expansion is static and a glob's directory is reported (``glob_dirs``)."""

_OPERATORS: Final = (
    # Longest first so that maximal munch picks ``&>>`` over ``&>`` over ``&``.
    ";;&",
    "&>>",
    "<<-",
    "<<<",
    "&&",
    "||",
    ";;",
    ";&",
    "|&",
    ">>",
    "<<",
    "<&",
    ">&",
    "<>",
    ">|",
    "&>",
    ";",
    "&",
    "|",
    "(",
    ")",
    "<",
    ">",
)
_OP_START: Final = frozenset(op[0] for op in _OPERATORS)
REDIRECT_OPS: Final = frozenset(
    {"<", ">", ">>", ">|", "<>", "<&", ">&", "&>", "&>>", "<<", "<<-", "<<<"}
)
WRITE_OPS: Final = frozenset({">", ">>", ">|", "<>", "&>", "&>>", ">&"})
_SEPARATORS: Final = frozenset({";", "&", "&&", "||", "|", "|&", "\n", ";;", ";&", ";;&"})
_RESERVED_SKIP: Final = frozenset(
    {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "{", "}", "!"}
)
_GLOB_CHARS: Final = frozenset("*?[")
_SPECIAL_CHARS: Final = frozenset(" \t\n'\"\\`$<>;&|()#")
_NAME_START: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_NAME_CHARS: Final = _NAME_START | frozenset("0123456789")
_SPECIAL_PARAMS: Final = frozenset("0123456789@*#?-$!")
MAX_DEPTH: Final = 8
"""Nesting limit for ``$(...)`` inside ``sh -c`` inside ``eval``...; deeper is undecidable."""
MAX_GROUP_DEPTH: Final = 64
"""Nesting limit for ``( ... )`` groups; deeper ones are read flat."""
MAX_TOKENS: Final = 16_384
"""Words and operators one string may have; past it :func:`parse` raises :class:`TooManyTokens`
at once rather than read the rest (16 per simple command of the most the gate accepts)."""
SCAN_BUDGET: Final = 400_000
"""Characters the look-ahead scans (matching ``)``, quotes, backticks) may read per string
beyond the string itself; past it the string is ``too_complex``."""


class TooManyTokens(ValueError):
    """A string with more than :data:`MAX_TOKENS` words and operators."""


@dataclass(slots=True)
class Word:
    """One shell word after quote removal.

    ``text`` is the word's value; the source of an expansion (``$HOME``, ``$(cmd)``) is kept in
    it verbatim. ``mask`` has one character per character of ``text``: ``"0"`` where the
    character was unquoted (so it may be a glob or brace character), ``"1"`` where it was quoted,
    escaped, or part of an expansion.
    """

    text: str = ""
    mask: str = ""
    raw: str = ""
    expansion: bool = False
    tilde: bool = False
    subs: list[Script] = field(default_factory=list)

    @property
    def glob(self) -> bool:
        """True when an unquoted ``*``, ``?`` or ``[`` makes the word a pattern."""
        if _GLOB_CHARS.isdisjoint(self.text):
            return False
        return any(c in _GLOB_CHARS and m == "0" for c, m in zip(self.text, self.mask, strict=True))

    @property
    def literal(self) -> bool:
        """True when the value is known statically (no expansion, no tilde)."""
        return not self.expansion and not self.tilde


@dataclass(slots=True)
class Redirect:
    """One redirection of a simple command."""

    op: str
    target: Word | None
    fd: str | None = None
    body: list[str] = field(default_factory=list)
    """For here-documents: the body (filled once the line after the command is read)."""
    body_literal: bool = True
    """For here-documents: False when the delimiter was unquoted (the body expands)."""
    subs: list[Script] = field(default_factory=list)
    """Command substitutions in an unquoted here-document body (they run)."""


@dataclass(slots=True)
class SimpleCommand:
    """A command with its words, assignments and redirections, and the operator after it."""

    words: list[Word] = field(default_factory=list)
    assignments: list[Word] = field(default_factory=list)
    redirects: list[Redirect] = field(default_factory=list)
    sep: str = ""


@dataclass(slots=True)
class Subshell:
    """A ``( ... )`` group: it runs in a child shell, so ``cd`` inside does not leak out."""

    body: list[SimpleCommand | Subshell] = field(default_factory=list)
    sep: str = ""


@dataclass(slots=True)
class Script:
    """What a command string runs, in order, plus the features seen while reading it."""

    body: list[SimpleCommand | Subshell] = field(default_factory=list)
    features: set[str] = field(default_factory=set)

    @property
    def undecidable(self) -> bool:
        """True when a feature makes what runs depend on run-time state."""
        return not self.features.isdisjoint(UNDECIDABLE_FEATURES)
