"""A static reader for POSIX shell command strings, for the policy gate.

It owns the tokenizer and the small parser that turn a string such as
``cd / && FOO=1 rm -rf "$X" *.o 2>/dev/null`` into the simple commands it would run, plus the
list of features that cannot be decided without running it (variable expansion, command
substitution, eval, here-documents, ...). It never executes anything.

Why not :mod:`shlex`: shlex drops quoting, so it cannot tell ``'$HOME'`` (a literal) from
``"$HOME"`` (an expansion) or ``'/*'`` from ``/*`` (a glob), and it does not know command
substitution, here-documents or redirections. Those differences decide what a command does.

This module imports nothing from sandlot: it is pure string processing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "MAX_TOKENS",
    "UNDECIDABLE_FEATURES",
    "Redirect",
    "Script",
    "SimpleCommand",
    "Subshell",
    "TooManyTokens",
    "Word",
    "expand_braces",
    "parse",
    "split_words",
]

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


class _WordBuilder:
    """Accumulates one word; lists keep long words linear (``str +=`` on an attribute is not)."""

    __slots__ = ("expansion", "m", "r", "subs", "t", "tilde")

    def __init__(self, *, tilde: bool = False) -> None:
        self.t: list[str] = []
        self.m: list[str] = []
        self.r: list[str] = []
        self.expansion = False
        self.tilde = tilde
        self.subs: list[Script] = []

    def add(self, text: str, quoted: bool, raw: str | None = None) -> None:
        self.t.append(text)
        self.m.append(("1" if quoted else "0") * len(text))
        self.r.append(text if raw is None else raw)

    def build(self) -> Word:
        return Word(
            text="".join(self.t),
            mask="".join(self.m),
            raw="".join(self.r),
            expansion=self.expansion,
            tilde=self.tilde,
            subs=self.subs,
        )


@dataclass(slots=True)
class _Token:
    kind: str  # "word", "op", "io"
    value: str
    word: Word | None = None
    redirect: Redirect | None = None


class _Tokenizer:
    """Turns source text into words and operators, reading here-document bodies on the way."""

    def __init__(self, src: str, depth: int, features: set[str]) -> None:
        self.src = src
        self.n = len(src)
        self.i = 0
        self.depth = depth
        self.features = features
        self.tokens: list[_Token] = []
        self.pending_heredocs: list[tuple[Redirect, str, bool]] = []
        self._heredoc_op: Redirect | None = None
        self._budget = SCAN_BUDGET

    # -- helpers -------------------------------------------------------------------------------

    def _spend(self, steps: int) -> bool:
        """Charge scanning work; False once the budget is gone (the string is then undecidable)."""
        self._budget -= steps
        if self._budget < 0:
            self.features.add("too_complex")
            return False
        return True

    def _stop(self, begin: int) -> int:
        """Where a scan starting at ``begin`` must stop: the end, or where the budget runs out."""
        return min(self.n, begin + max(self._budget, 0))

    def _find_close_paren(self, start: int, level: int = 0) -> int:
        """Index of the ``)`` closing a ``(`` that opened just before ``start``; -1 if none.

        Scans are charged to a budget and nest at most ``MAX_GROUP_DEPTH`` deep: a string built
        to make matching quadratic or recursive becomes ``too_complex`` instead.
        """
        if level > MAX_GROUP_DEPTH:
            self.features.add("too_complex")
            return -1
        depth = 1
        i = start
        src = self.src
        begin = start
        stop = self._stop(begin)
        while i < stop:
            c = src[i]
            if c == "\\":
                i += 2
                continue
            if c == "'":
                j = src.find("'", i + 1)
                if j < 0:
                    break
                i = j + 1
                continue
            if c == '"':
                i = self._skip_double(i + 1, level + 1)
                if i < 0:
                    return -1
                continue
            if c == "`":
                j = self._find_backtick(i + 1)
                if j < 0:
                    break
                i = j + 1
                continue
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    return i if self._spend(i - begin) else -1
            i += 1
        # +1: a scan cut short by the budget leaves it negative, which marks the string.
        self._spend(i - begin + 1)
        return -1

    def _skip_double(self, i: int, level: int = 0) -> int:
        """Index just past the ``"`` closing a double-quoted string starting at ``i``."""
        if level > MAX_GROUP_DEPTH or self._budget < 0:
            self.features.add("too_complex")
            return -1
        src = self.src
        begin = i
        stop = self._stop(begin)
        while i < stop:
            c = src[i]
            if c == "\\":
                i += 2
                continue
            if c == '"':
                return i + 1 if self._spend(i - begin) else -1
            if c == "$" and i + 1 < self.n and src[i + 1] == "(":
                j = self._find_close_paren(i + 2, level + 1)
                if j < 0:
                    return -1
                i = j + 1
                continue
            if c == "`":
                j = self._find_backtick(i + 1)
                if j < 0:
                    return -1
                i = j + 1
                continue
            i += 1
        # +1: a scan cut short by the budget leaves it negative, which marks the string.
        self._spend(i - begin + 1)
        return -1

    def _find_backtick(self, i: int) -> int:
        src = self.src
        begin = i
        stop = self._stop(begin)
        while i < stop:
            c = src[i]
            if c == "\\":
                i += 2
                continue
            if c == "`":
                return i if self._spend(i - begin) else -1
            i += 1
        # +1: a scan cut short by the budget leaves it negative, which marks the string.
        self._spend(i - begin + 1)
        return -1

    def _find_close_brace(self, i: int) -> int:
        depth = 1
        src = self.src
        begin = i
        stop = self._stop(begin)
        while i < stop:
            c = src[i]
            if c == "\\":
                i += 2
                continue
            if c == "'":
                j = src.find("'", i + 1)
                if j < 0:
                    break
                i = j + 1
                continue
            if c == '"':
                i = self._skip_double(i + 1, 1)
                if i < 0:
                    return -1
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return i if self._spend(i - begin) else -1
            i += 1
        # +1: a scan cut short by the budget leaves it negative, which marks the string.
        self._spend(i - begin + 1)
        return -1

    def _sub_script(self, inner: str) -> Script:
        if self.depth + 1 > MAX_DEPTH:
            self.features.add("too_deep")
            return Script()
        sub = parse(inner, depth=self.depth + 1)
        self.features |= sub.features
        return sub

    def _dollar(self, word: _WordBuilder, *, quoted: bool = False) -> None:
        """Read an expansion starting at ``$`` (self.i points at it) into ``word``."""
        src = self.src
        i = self.i
        nxt = src[i + 1] if i + 1 < self.n else ""
        end = -1
        if quoted and nxt in ("'", '"', ""):
            nxt = " "  # inside double quotes these leave the "$" literal
        if src.startswith("$((", i):
            close = self._find_close_paren(i + 3)
            if close >= 0 and close + 1 < self.n and src[close + 1] == ")":
                end = close + 1
                self.features.add("arithmetic")
            else:
                # "$( (cmd) )": a command substitution that starts with a subshell.
                end = self._find_close_paren(i + 2)
                if end >= 0:
                    word.subs.append(self._sub_script(src[i + 2 : end]))
                self.features.add("command_substitution")
        elif nxt == "(":
            end = self._find_close_paren(i + 2)
            if end >= 0:
                word.subs.append(self._sub_script(src[i + 2 : end]))
            self.features.add("command_substitution")
        elif nxt == "{":
            end = self._find_close_brace(i + 2)
            self.features.add("variable")
        elif nxt == "'":
            self._ansi_c(word)
            return
        elif nxt == '"':
            # $"..." is a locale-translated string; treat it as a plain double-quoted one.
            self.i += 1
            return
        elif nxt and nxt in _NAME_START:
            end = i + 1
            while end + 1 < self.n and src[end + 1] in _NAME_CHARS:
                end += 1
            self.features.add("variable")
        elif nxt and nxt in _SPECIAL_PARAMS:
            end = i + 1
            self.features.add("variable")
        else:
            word.add("$", quoted)
            self.i += 1
            return
        if end < 0:
            self.features.add("parse_error")
            end = self.n - 1
        word.add(src[i : end + 1], True)
        word.expansion = True
        self.i = end + 1

    def _ansi_c(self, word: _WordBuilder) -> None:
        """Read ``$'...'``: a static string with C escapes."""
        src = self.src
        i = self.i + 2
        out: list[str] = []
        simple = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}
        simple |= {"e": "\x1b", "E": "\x1b", "\\": "\\", "'": "'", '"': '"', "?": "?"}
        while i < self.n and src[i] != "'":
            c = src[i]
            if c == "\\" and i + 1 < self.n:
                e = src[i + 1]
                if e in simple:
                    out.append(simple[e])
                    i += 2
                    continue
                digits = ""
                if e == "x":
                    j = i + 2
                    while j < self.n and len(digits) < 2 and src[j] in "0123456789abcdefABCDEF":
                        digits += src[j]
                        j += 1
                    if digits:
                        out.append(chr(int(digits, 16)))
                        i = j
                        continue
                if e in "01234567":
                    j = i + 1
                    while j < self.n and len(digits) < 3 and src[j] in "01234567":
                        digits += src[j]
                        j += 1
                    out.append(chr(int(digits, 8)))
                    i = j
                    continue
                # Escapes we do not decode (\u, \c...) make the value unknown to us.
                self.features.add("variable")
                word.expansion = True
                out.append(c)
                i += 1
                continue
            out.append(c)
            i += 1
        if i >= self.n:
            self.features.add("parse_error")
        word.add("".join(out), True, src[self.i : i + 1])
        self.i = i + 1

    def _read_heredoc_bodies(self) -> None:
        """Called just after a newline: consume the bodies of pending here-documents."""
        src = self.src
        for redirect, delim, strip_tabs in self.pending_heredocs:
            while self.i < self.n:
                j = src.find("\n", self.i)
                line = src[self.i : j] if j >= 0 else src[self.i :]
                self.i = j + 1 if j >= 0 else self.n
                check = line.lstrip("\t") if strip_tabs else line
                if check == delim:
                    break
                redirect.body.append(line)
            else:
                self.features.add("parse_error")
            if not redirect.body_literal:
                for line in redirect.body:
                    self._body_substitutions(line, redirect.subs)
        self.pending_heredocs.clear()

    def _body_substitutions(self, line: str, into: list[Script]) -> None:
        """Parse the ``$(...)`` and backticks of an unquoted here-document body: they run."""
        reader = _Tokenizer(line, self.depth, self.features)
        i = 0
        while i < reader.n:
            c = line[i]
            if c == "\\":
                i += 2
                continue
            if c == "$" and i + 1 < reader.n and line[i + 1] == "(":
                end = reader._find_close_paren(i + 2)
                if end < 0:
                    self.features.add("parse_error")
                    return
                into.append(self._sub_script(line[i + 2 : end]))
                self.features.add("command_substitution")
                i = end + 1
                continue
            if c == "`":
                end = reader._find_backtick(i + 1)
                if end < 0:
                    self.features.add("parse_error")
                    return
                into.append(self._sub_script(_unescape_backtick(line[i + 1 : end])))
                self.features.add("backtick")
                i = end + 1
                continue
            i += 1

    # -- main loop -----------------------------------------------------------------------------

    def _emit_word(self, builder: _WordBuilder | None) -> None:
        if builder is None:
            return
        word = builder.build()
        if self._heredoc_op is not None:
            redirect = self._heredoc_op
            self._heredoc_op = None
            quoted = "1" in word.mask
            redirect.body_literal = quoted
            redirect.target = word
            self.pending_heredocs.append((redirect, word.text, redirect.op == "<<-"))
        self.tokens.append(_Token("word", word.text, word=word))

    def run(self) -> list[_Token]:
        src = self.src
        word: _WordBuilder | None = None
        while self.i < self.n:
            if len(self.tokens) > MAX_TOKENS:
                msg = f"more than {MAX_TOKENS} words and operators"
                raise TooManyTokens(msg)
            c = src[self.i]
            if c in " \t":
                self._emit_word(word)
                word = None
                self.i += 1
                continue
            if c == "\n":
                self._emit_word(word)
                word = None
                self.tokens.append(_Token("op", "\n"))
                self.i += 1
                if self.pending_heredocs:
                    self._read_heredoc_bodies()
                continue
            if c == "#" and word is None:
                j = src.find("\n", self.i)
                self.i = j if j >= 0 else self.n
                continue
            if c == "\\":
                if self.i + 1 < self.n and src[self.i + 1] == "\n":
                    self.i += 2  # line continuation
                    continue
                word = word or _WordBuilder()
                if self.i + 1 < self.n:
                    word.add(src[self.i + 1], True, src[self.i : self.i + 2])
                self.i += 2
                continue
            if c == "'":
                word = word or _WordBuilder()
                j = src.find("'", self.i + 1)
                if j < 0:
                    self.features.add("parse_error")
                    j = self.n
                word.add(src[self.i + 1 : j], True, src[self.i : j + 1])
                self.i = j + 1
                continue
            if c == '"':
                word = word or _WordBuilder()
                self._double(word)
                continue
            if c == "`":
                word = word or _WordBuilder()
                end = self._find_backtick(self.i + 1)
                if end < 0:
                    self.features.add("parse_error")
                    end = self.n
                word.subs.append(self._sub_script(_unescape_backtick(src[self.i + 1 : end])))
                self.features.add("backtick")
                word.add(src[self.i : end + 1], True)
                word.expansion = True
                self.i = end + 1
                continue
            if c == "$":
                word = word or _WordBuilder()
                self._dollar(word)
                continue
            if c in "<>" and self.i + 1 < self.n and src[self.i + 1] == "(":
                # Process substitution: <(cmd) or >(cmd) runs cmd and becomes a /dev/fd path.
                end = self._find_close_paren(self.i + 2)
                word = word or _WordBuilder()
                if end < 0:
                    self.features.add("parse_error")
                    end = self.n
                else:
                    word.subs.append(self._sub_script(src[self.i + 2 : end]))
                self.features.add("process_substitution")
                word.add(src[self.i : end + 1], True)
                word.expansion = True
                self.i = end + 1
                continue
            if c == "(" and word is None and src.startswith("((", self.i):
                # "((...))" may be arithmetic or nested subshells; reading it as subshells
                # too means no command inside can hide.
                self.features.add("arithmetic")
            if c in _OP_START:
                if c in "<>" and word is not None:
                    text = "".join(word.t)
                    if text.isdigit() and "1" not in "".join(word.m):
                        # "2>file": the digits name the file descriptor, not an argument.
                        self.tokens.append(_Token("io", text))
                        word = None
                self._emit_word(word)
                word = None
                for op in _OPERATORS:
                    if src.startswith(op, self.i):
                        break
                tok = _Token("op", op)
                if op in REDIRECT_OPS:
                    tok.redirect = Redirect(op=op, target=None)
                    if op in ("<<", "<<-"):
                        self._heredoc_op = tok.redirect
                        self.features.add("heredoc")
                self.tokens.append(tok)
                self.i += len(op)
                continue
            if word is None:
                word = _WordBuilder(tilde=c == "~")
            # Runs of plain characters are added in one piece.
            j = self.i + 1
            while j < self.n and src[j] not in _SPECIAL_CHARS:
                j += 1
            word.add(src[self.i : j], False)
            self.i = j
        self._emit_word(word)
        if self.pending_heredocs:
            # A here-document with no body before the end of the string.
            self._read_heredoc_bodies()
        return self.tokens

    def _double(self, word: _WordBuilder) -> None:
        src = self.src
        start = self.i
        self.i += 1
        raw_before = len(word.r)
        while self.i < self.n:
            c = src[self.i]
            if c == '"':
                self.i += 1
                break
            if c == "\\" and self.i + 1 < self.n:
                e = src[self.i + 1]
                if e == "\n":
                    self.i += 2
                    continue
                if e in '$`"\\':
                    word.add(e, True)
                    self.i += 2
                    continue
                word.add("\\", True)
                self.i += 1
                continue
            if c == "$":
                self._dollar(word, quoted=True)
                continue
            if c == "`":
                end = self._find_backtick(self.i + 1)
                if end < 0:
                    self.features.add("parse_error")
                    end = self.n
                word.subs.append(self._sub_script(_unescape_backtick(src[self.i + 1 : end])))
                self.features.add("backtick")
                word.add(src[self.i : end + 1], True)
                word.expansion = True
                self.i = end + 1
                continue
            j = self.i + 1
            while j < self.n and src[j] not in '"\\$`':
                j += 1
            word.add(src[self.i : j], True)
            self.i = j
        else:
            self.features.add("parse_error")
        # ``raw`` keeps the quoted source exactly as written.
        del word.r[raw_before:]
        word.r.append(src[start : self.i])


def _unescape_backtick(s: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in "$`\\":
            out.append(s[i + 1])
            i += 2
            continue
        out.append(s[i])
        i += 1
    return "".join(out)


def _is_assignment(word: Word) -> bool:
    eq = word.text.find("=")
    if eq <= 0 or word.mask[0] != "0":
        return False
    name = word.text[:eq].removesuffix("+")
    return (
        bool(name)
        and name[0] in _NAME_START
        and all(ch in _NAME_CHARS for ch in name)
        and word.mask[:eq] == "0" * eq
    )


class _Parser:
    """Groups tokens into simple commands and subshells; skips reserved words."""

    def __init__(self, tokens: list[_Token], features: set[str]) -> None:
        self.tokens = tokens
        self.features = features
        self.i = 0
        self.depth = 0

    def parse(self, until_close: bool = False) -> list[SimpleCommand | Subshell]:
        body: list[SimpleCommand | Subshell] = []
        cmd = SimpleCommand()
        case_patterns = False  # inside "case ... in", before a pattern's ")"
        skip_until_sep = False  # the rest of a "for NAME in ..." header
        in_test = False  # inside [[ ... ]]

        def finish(sep: str) -> None:
            nonlocal cmd
            cmd.sep = sep
            if cmd.words or cmd.redirects or cmd.assignments:
                body.append(cmd)
            elif body and sep:
                body[-1].sep = sep
            cmd = SimpleCommand()

        while self.i < len(self.tokens):
            tok = self.tokens[self.i]
            self.i += 1
            if tok.kind == "op":
                op = tok.value
                if in_test and op not in ("\n",):
                    continue
                if case_patterns:
                    if op == ")":
                        case_patterns = False
                    continue
                if op in _SEPARATORS:
                    skip_until_sep = False
                    finish(op)
                    if op in (";;", ";&", ";;&"):
                        case_patterns = True
                    continue
                if op == "(" and self.depth >= MAX_GROUP_DEPTH:
                    # Deeper groups are read flat: same commands, no recursion to exhaust.
                    self.features.add("too_deep")
                    finish("")
                    continue
                if op == "(":
                    if cmd.words and not cmd.assignments and len(cmd.words) == 1:
                        # name ( ) { body } : a function definition.
                        self.features.add("function")
                        if self.i < len(self.tokens) and self.tokens[self.i].value == ")":
                            self.i += 1
                        cmd = SimpleCommand()
                        continue
                    finish("")
                    self.depth += 1
                    inner = self.parse(until_close=True)
                    self.depth -= 1
                    body.append(Subshell(body=inner))
                    continue
                if op == ")":
                    if until_close:
                        finish("")
                        return body
                    self.features.add("parse_error")
                    continue
                if tok.redirect is not None:
                    redirect = tok.redirect
                    if self.i < len(self.tokens) and self.tokens[self.i].kind == "word":
                        target = self.tokens[self.i].word
                        redirect.target = target
                        self.i += 1
                        if target is not None and target.subs:
                            for sub in target.subs:
                                body.extend(sub.body)
                    else:
                        self.features.add("parse_error")
                    cmd.redirects.append(redirect)
                    for sub in redirect.subs:
                        body.extend(sub.body)
                    continue
                continue
            if tok.kind == "io":
                nxt = self.tokens[self.i] if self.i < len(self.tokens) else None
                if nxt is not None and nxt.redirect is not None:
                    nxt.redirect.fd = tok.value
                continue
            word = tok.word
            assert word is not None
            if in_test:
                if word.text == "]]" and word.mask == "00":
                    in_test = False
                for sub in word.subs:
                    body.extend(sub.body)
                continue
            if case_patterns or skip_until_sep:
                for sub in word.subs:
                    body.extend(sub.body)
                continue
            # Substitutions inside a word run before the command that contains the word.
            for sub in word.subs:
                body.extend(sub.body)
            at_start = not cmd.words
            unquoted = "1" not in word.mask
            if at_start and unquoted:
                name = word.text
                if name in _RESERVED_SKIP and not cmd.assignments:
                    continue
                if name in ("for", "select") and not cmd.assignments:
                    skip_until_sep = True
                    continue
                if name == "case" and not cmd.assignments:
                    self.features.add("case")
                    # Skip "WORD in", then read patterns up to ")".
                    self.i += 2
                    case_patterns = True
                    continue
                if name == "esac":
                    continue
                if name == "function" and not cmd.assignments:
                    self.features.add("function")
                    self.i += 1
                    continue
                if name == "[[" and not cmd.assignments:
                    in_test = True
                    continue
            if at_start and _is_assignment(word):
                cmd.assignments.append(word)
                continue
            cmd.words.append(word)
        finish("")
        if until_close:
            self.features.add("parse_error")
        return body


def parse(source: str, *, depth: int = 0) -> Script:
    """Read a shell command string into the commands it runs.

    Args:
        source: The string a shell would be given with ``-c``.
        depth: How deep we already are in nested strings (``sh -c`` in ``$(...)``...).

    Returns:
        The commands in execution order (command substitutions before the command that uses
        them), grouped in subshells where parentheses say so, and the features seen.
    """
    features: set[str] = set()
    if depth > MAX_DEPTH:
        return Script(features={"too_deep"})
    tokens = _Tokenizer(source, depth, features).run()
    body = _Parser(tokens, features).parse()
    return Script(body=body, features=features)


def split_words(source: str) -> tuple[list[Word], set[str]]:
    """Split a string into words the way ``env -S`` and ``eval`` see them (no operators)."""
    features: set[str] = set()
    tokens = _Tokenizer(source, 0, features).run()
    return [t.word for t in tokens if t.word is not None], features


def expand_braces(word: Word, limit: int = 256) -> list[Word]:
    """Expand unquoted ``{a,b}`` and ``{1..3}`` patterns (bash does this before anything else).

    Returns the word itself when it has no brace pattern. ``limit`` bounds the number of
    results so that ``{1..99999999}`` cannot blow up the gate.
    """
    text, mask = word.text, word.mask
    if "{" not in text:
        return [word]
    results = _expand(text, mask, limit)
    if len(results) == 1 and results[0][0] == text:
        return [word]
    return [
        Word(
            text=t, mask=m, raw=word.raw, expansion=word.expansion, tilde=word.tilde, subs=word.subs
        )
        for t, m in results
    ]


def _expand(text: str, mask: str, limit: int) -> list[tuple[str, str]]:
    for start, ch in enumerate(text):
        if ch != "{" or mask[start] != "0":
            continue
        depth = 0
        commas: list[int] = []
        end = -1
        for j in range(start, len(text)):
            if mask[j] != "0":
                continue
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    end = j
                    break
            elif text[j] == "," and depth == 1:
                commas.append(j)
        if end < 0:
            return [(text, mask)]
        pre, pre_m = text[:start], mask[:start]
        post, post_m = text[end + 1 :], mask[end + 1 :]
        inner, inner_m = text[start + 1 : end], mask[start + 1 : end]
        alternatives: list[tuple[str, str]] = []
        if commas:
            bounds = [start, *commas, end]
            for a, b in itertools.pairwise(bounds):
                alternatives.append((text[a + 1 : b], mask[a + 1 : b]))
        else:
            seq = _sequence(inner, limit) if "1" not in inner_m else None
            if seq is None:
                # Not a brace pattern ("{}" or "{x}"): keep the braces literal, look further on.
                rest = _expand(post, post_m, limit)
                head = pre + "{" + inner + "}"
                head_m = pre_m + "1" + inner_m + "1"
                return [(head + t, head_m + m) for t, m in rest][:limit]
            alternatives = [(s, "1" * len(s)) for s in seq]
        out: list[tuple[str, str]] = []
        for alt, alt_m in alternatives:
            for t, m in _expand(alt + post, alt_m + post_m, limit):
                out.append((pre + t, pre_m + m))
                if len(out) >= limit:
                    return out
        return out
    return [(text, mask)]


def _sequence(inner: str, limit: int) -> list[str] | None:
    parts = inner.split("..")
    if len(parts) not in (2, 3):
        return None
    step = 1
    if len(parts) == 3:
        try:
            step = abs(int(parts[2])) or 1
        except ValueError:
            return None
    a, b = parts[0], parts[1]
    try:
        x, y = int(a), int(b)
    except ValueError:
        if len(a) == 1 and len(b) == 1 and a.isalpha() and b.isalpha():
            x, y = ord(a), ord(b)
            rng = range(x, y + 1, step) if x <= y else range(x, y - 1, -step)
            return [chr(v) for v in rng][:limit]
        return None
    rng = range(x, y + 1, step) if x <= y else range(x, y - 1, -step)
    return [str(v) for v in rng][:limit]
