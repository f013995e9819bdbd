"""A static reader for POSIX shell command strings, for the policy gate.

It owns the tokenizer and the small parser that turn a string such as
``cd / && FOO=1 rm -rf "$X" *.o 2>/dev/null`` into the simple commands it would run, plus the
list of features that cannot be decided without running it (variable expansion, command
substitution, eval, here-documents, ...). It never executes anything.

Why not :mod:`shlex`: shlex drops quoting, so it cannot tell ``'$HOME'`` (a literal) from
``"$HOME"`` (an expansion) or ``'/*'`` from ``/*`` (a glob), and it does not know command
substitution, here-documents or redirections. Those differences decide what a command does.

The vocabulary and the nodes are in :mod:`~sandlot.policy.shell_syntax`, the tokenizer in
:mod:`~sandlot.policy.shell_tokenizer`; this module is the parser and the public face (import
the names from here). None of them imports anything from sandlot: pure string processing.
"""

from __future__ import annotations

import itertools

from sandlot.policy.shell_syntax import (
    _NAME_CHARS,
    _NAME_START,
    _RESERVED_SKIP,
    _SEPARATORS,
    MAX_DEPTH,
    MAX_GROUP_DEPTH,
    MAX_TOKENS,
    REDIRECT_OPS,
    UNDECIDABLE_FEATURES,
    WRITE_OPS,
    Redirect,
    Script,
    SimpleCommand,
    Subshell,
    TooManyTokens,
    Word,
)
from sandlot.policy.shell_tokenizer import (
    _Token,
    _Tokenizer,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_TOKENS",
    "REDIRECT_OPS",
    "UNDECIDABLE_FEATURES",
    "WRITE_OPS",
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
