"""The shell tokenizer: a string to words (with quoting, expansions and globs marked),
operators and redirections, noting each feature it meets.

Part of :mod:`sandlot.policy.shell`. Imports nothing from sandlot but the shell reader's
vocabulary (:mod:`sandlot.policy.shell_syntax`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sandlot.policy.shell_syntax import (
    _NAME_CHARS,
    _NAME_START,
    _OP_START,
    _OPERATORS,
    _SPECIAL_CHARS,
    _SPECIAL_PARAMS,
    MAX_DEPTH,
    MAX_GROUP_DEPTH,
    MAX_TOKENS,
    REDIRECT_OPS,
    SCAN_BUDGET,
    Redirect,
    Script,
    TooManyTokens,
    Word,
)


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
        # A substitution is a script of its own: the parser and the tokenizer recurse into
        # each other, so the parser is imported where it is needed, not at module load.
        from sandlot.policy.shell import parse

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
