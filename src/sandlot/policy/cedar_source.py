"""Where things are in Cedar text: the file, line and column behind an error or a policy.

cedarpy reports a parse error with no position (``unexpected token `;```) and a validation
error under Cedar's positional policy id (``policy0``), which names nothing a user wrote. This
module finds the position itself:

- the text is split into tokens and into statements (each policy ends with a ``;`` outside
  strings and comments, which is also how Cedar numbers them: ``policyN`` is statement N);
- a statement that does not parse alone is cut after each token and the cuts are parsed
  (binary search): the first cut that fails with anything but "unexpected end of input" ends
  with the offending token. An LR parser accepts every prefix of a parsable text up to the
  first bad token, so the search is exact for syntax errors; an error found only once the
  statement is complete (``invalid variable: foo``) is placed on the word it names;
- several files are joined for Cedar, and every offset maps back to its own file.

Errors are raised as one-line :class:`~sandlot.errors.InvalidRequest` messages in the usual
``path:line:column: what is wrong`` form. Only the error paths parse more than once.

This module may import cedarpy and :mod:`sandlot.errors`; nothing else from sandlot.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, final

import cedarpy

from sandlot.errors import InvalidRequest

__all__ = ["PolicyFile", "SourceMap", "Statement", "Token", "schema_error", "tokenize"]

_TOKEN: Final = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*(?:"|\Z))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>[0-9]+)
  | (?P<op>::|==|!=|<=|>=|&&|\|\||.)
    """,
    re.VERBOSE | re.DOTALL,
)
_EOF: Final = "unexpected end of input"
_SYNTAX: Final = ("unexpected token", "invalid token", "unexpected end of input")
_OPEN: Final = frozenset("([{")
_CLOSE: Final = frozenset(")]}")
_QUOTED: Final = re.compile(r"`([^`]+)`")


@final
@dataclass(frozen=True, slots=True)
class Token:
    """One Cedar token (whitespace and comments are not tokens)."""

    kind: str
    """``string``, ``ident``, ``number`` or ``op``."""
    text: str
    start: int
    end: int


@final
@dataclass(frozen=True, slots=True)
class Statement:
    """One policy's tokens: from its first annotation to its ``;`` (or to the end)."""

    tokens: tuple[Token, ...]

    @property
    def start(self) -> int:
        """Offset of its first token."""
        return self.tokens[0].start

    @property
    def end(self) -> int:
        """Offset just after its last token."""
        return self.tokens[-1].end


@final
@dataclass(frozen=True, slots=True)
class PolicyFile:
    """A policy file's name (as the user wrote it) and its text."""

    name: str
    text: str


def tokenize(text: str) -> list[Token]:
    """The tokens of Cedar policy or schema text; an unterminated string runs to the end."""
    out: list[Token] = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup or "op"
        if kind not in ("ws", "comment"):
            out.append(Token(kind, m.group(), m.start(), m.end()))
    return out


def statements(tokens: Sequence[Token]) -> list[Statement]:
    """Group tokens into statements, each ending with a ``;`` (the last one may not)."""
    out: list[Statement] = []
    current: list[Token] = []
    for tok in tokens:
        current.append(tok)
        if tok.kind == "op" and tok.text == ";":
            out.append(Statement(tuple(current)))
            current = []
    if current:
        out.append(Statement(tuple(current)))
    return out


def _lines(text: str) -> list[int]:
    return [0, *(m.end() for m in re.finditer("\n", text))]


@final
class SourceMap:
    """Several policy files joined with newlines (what Cedar parses), and the way back."""

    def __init__(self, files: Sequence[PolicyFile]) -> None:
        """Join ``files`` in order."""
        self.files = tuple(files)
        self.text = "\n".join(f.text for f in self.files)
        self._starts: list[int] = []
        offset = 0
        for f in self.files:
            self._starts.append(offset)
            offset += len(f.text) + 1
        self._line_starts = [_lines(f.text) for f in self.files]
        self._statements: list[Statement] | None = None

    def statements(self) -> list[Statement]:
        """The statements of the joined text (statement N is Cedar's ``policyN``)."""
        if self._statements is None:
            self._statements = statements(tokenize(self.text))
        return self._statements

    def position(self, offset: int) -> tuple[str, int, int]:
        """``(file name, line, column)`` of an offset in the joined text (1-based)."""
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        local = min(offset - self._starts[i], len(self.files[i].text))
        starts = self._line_starts[i]
        line = bisect.bisect_right(starts, local)
        return self.files[i].name, line, local - starts[line - 1] + 1

    def where(self, offset: int, *, column: bool = True) -> str:
        """``path:line:column`` (or ``path:line``) of an offset in the joined text."""
        name, line, col = self.position(offset)
        return f"{name}:{line}:{col}" if column else f"{name}:{line}"

    def check_parses(self) -> None:
        """Raise the located parse error of the first file that does not parse alone.

        Each file must be a complete policy set by itself, so an unfinished last policy is
        blamed on its own file rather than on the next one.

        Raises:
            InvalidRequest: ``path:line:column: the Cedar policy does not parse: ...``.
        """
        for i, f in enumerate(self.files):
            try:
                cedarpy.PolicySet.from_str(f.text)
            except ValueError as e:
                message = str(e)
            else:
                continue
            base = self._starts[i]
            for stmt in statements(tokenize(f.text)):
                problem = _parse_problem(f.text[stmt.start : stmt.end])
                if problem is None:
                    continue
                offset, detail = _locate_parse_error(f.text, stmt, problem)
                msg = f"{self.where(base + offset)}: the Cedar policy does not parse: {detail}"
                raise InvalidRequest(msg)
            # Every policy parses alone but the file does not: say so without a position.
            msg = f"{f.name}: the Cedar policies do not parse: {message}"
            raise InvalidRequest(msg)

    def locate_words(self, stmt: Statement, message: str) -> int:
        """The offset of the first word ``message`` quotes that occurs in ``stmt`` (else its start)."""
        return _find_quoted(stmt.tokens, message, stmt.start)


def _parse_problem(text: str) -> str | None:
    try:
        cedarpy.PolicySet.from_str(text)
    except ValueError as e:
        return str(e)
    return None


def _first_bad_token(
    text: str, tokens: Sequence[Token], fails: Callable[[str], bool]
) -> Token | None:
    """The first token after which the text fails in a way a longer text cannot repair."""
    lo, hi = 0, len(tokens) - 1
    found: Token | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fails(text[: tokens[mid].end]):
            found, hi = tokens[mid], mid - 1
        else:
            lo = mid + 1
    return found


def _step_back(tokens: Sequence[Token], bad: Token | None, problem: str) -> Token | None:
    """The token an ``unexpected token `X``` error names, at or before the first bad cut.

    Cedar's parser may report a bad token only once it has read the next one (``{ 1 + }``
    fails only with the ``;`` after it), so the cut can end one token late.
    """
    named = _QUOTED.search(problem) if problem.startswith("unexpected token") else None
    if bad is None or named is None:
        return bad
    k = tokens.index(bad)
    back = [t for t in tokens[: k + 1] if t.text == named.group(1)]
    return back[-1] if back else bad


def _missing_semicolon(stmt: Statement) -> Token | None:
    """A policy start (``permit``, ``forbid``, ``@``) right after a policy's closed scope or
    condition: the ``;`` between two policies is missing."""
    depth = 0
    effect_seen = False
    prev: Token | None = None
    for tok in stmt.tokens:
        after_close = prev is not None and prev.kind == "op" and prev.text in _CLOSE
        if depth == 0 and effect_seen and after_close and tok.text in ("permit", "forbid", "@"):
            return tok
        # The effect is the first word outside the annotations (``@id(...)``).
        if depth == 0 and tok.kind == "ident" and (prev is None or prev.text != "@"):
            effect_seen = True
        if tok.kind == "op" and tok.text in _OPEN:
            depth += 1
        elif tok.kind == "op" and tok.text in _CLOSE:
            depth -= 1
        prev = tok
    return None


def _locate_parse_error(text: str, stmt: Statement, problem: str) -> tuple[int, str]:
    """Where in ``text`` the statement's parse error is, and the message to show."""
    if problem == _EOF:
        where = text.count("\n", 0, stmt.start) + 1
        return stmt.end, f"{problem} (the policy that starts on line {where} is not finished)"

    def fails(prefix: str) -> bool:
        error = _parse_problem(prefix[stmt.start :])
        return error is not None and error != _EOF

    bad = _step_back(stmt.tokens, _first_bad_token(text, stmt.tokens, fails), problem)
    detail = problem
    hint = _missing_semicolon(stmt)
    if hint is not None and (bad is None or bad.start >= hint.start):
        line = text.count("\n", 0, hint.start) + 1
        col = hint.start - (text.rfind("\n", 0, hint.start) + 1) + 1
        detail += f" (is a `;` missing before line {line}, column {col}?)"
    if bad is not None and (bad is not stmt.tokens[-1] or problem.startswith(_SYNTAX)):
        return bad.start, detail
    # Only the complete policy fails (``invalid variable: foo``): point at the word named.
    return _find_quoted(stmt.tokens, problem, stmt.start), detail


def _words(message: str) -> list[str]:
    """Words an error message names: in backticks, or after its last ``: ``."""
    words = _QUOTED.findall(message)
    _, sep, tail = message.rpartition(": ")
    names = [w.strip() for w in tail.split(",")] if sep else []
    if names and all(w and " " not in w for w in names):
        words.extend(names)
    out: list[str] = []
    for w in words:
        w = w.lstrip("@")
        if "::" in w:
            w = w.rpartition("::")[2]
        out.append(w.strip('"'))
    return [w for w in out if w]


def _find_quoted(tokens: Sequence[Token], message: str, default: int) -> int:
    second = "twice" in message or "duplicate" in message
    for word in _words(message):
        hits: list[int] = []
        attribute_hits: list[int] = []
        for i, t in enumerate(tokens):
            escape = "\\" in word and t.kind == "string" and word in t.text
            if t.text == word or escape or (t.kind == "string" and t.text.strip('"') == word):
                hits.append(t.start)
                if i and tokens[i - 1].text in (".", "has"):
                    attribute_hits.append(t.start)
        # An attribute the schema lacks is the one read as `x.word` or `x has word`.
        hits = attribute_hits or hits
        if hits:
            return hits[1] if second and len(hits) > 1 else hits[0]
    return default


def schema_error(name: str, text: str, error: str) -> InvalidRequest:
    """The located error for a schema that does not parse (cedarpy says only what, not where)."""
    problem = error.removeprefix("error parsing schema: ")
    tokens = tokenize(text)

    def fails(prefix: str) -> bool:
        try:
            cedarpy.Schema.from_str(prefix)
        except ValueError as e:
            rest = str(e).removeprefix("error parsing schema: ")
            return rest.startswith(_SYNTAX[:2])
        return False

    offset: int | None = None
    if tokens and problem.startswith(_SYNTAX[:2]):
        bad = _step_back(tokens, _first_bad_token(text, tokens, fails), problem)
        offset = bad.start if bad is not None else None
    elif tokens and problem == _EOF:
        offset = tokens[-1].end
    elif tokens:
        offset = _find_quoted(tokens, problem, -1)
    if offset is None or offset < 0:
        return InvalidRequest(f"{name}: the Cedar schema does not parse: {problem}")
    where = SourceMap([PolicyFile(name, text)]).where(offset)
    return InvalidRequest(f"{where}: the Cedar schema does not parse: {problem}")


_FOR_POLICY: Final = re.compile(r"^for policy `[^`]*`, ")
_FOR_ACTION: Final = re.compile(r' for Action::"((?:[^"\\]|\\.)*)"')
_POLICY_N: Final = re.compile(r"policy(\d+)")


def statement_of(source: SourceMap, policy_id: str) -> Statement | None:
    """The statement behind Cedar's positional id ``policyN`` (None for any other id)."""
    m = _POLICY_N.fullmatch(policy_id)
    stmts = source.statements()
    if m is None or int(m.group(1)) >= len(stmts):
        return None
    return stmts[int(m.group(1))]


def policy_label(source: SourceMap, policy_id: str, names: dict[str, str]) -> str:
    """How a message names a policy: ``policy "its @id"``, else the line it starts on (the
    message starts with the file's name)."""
    if policy_id in names:
        return f'policy "{names[policy_id]}"'
    stmt = statement_of(source, policy_id)
    if stmt is None:
        return f"policy {policy_id}"
    _, line, _ = source.position(stmt.start)
    return f"the policy starting on line {line}"


def validation_error(
    source: SourceMap, errors: Sequence[tuple[str, str]], names: dict[str, str]
) -> InvalidRequest:
    """One line for policies that do not validate: the first one in full, the others by place.

    Cedar repeats an error once per action a policy applies to (``attribute `progam` in context
    for Action::"exec" not found``, 27 times for a policy on every action); those are folded
    into one problem that counts the actions.
    """
    by_policy: dict[str, dict[str, list[str]]] = {}
    for pid, error in errors:
        text = _FOR_POLICY.sub("", error)
        actions = _FOR_ACTION.findall(text)
        key = _FOR_ACTION.sub("", text)
        by_policy.setdefault(pid, {}).setdefault(key, []).extend(actions)

    def order(pid: str) -> int:
        m = _POLICY_N.fullmatch(pid)
        return int(m.group(1)) if m else 1 << 30

    pids = sorted(by_policy, key=order)
    first = pids[0]
    problems: list[str] = []
    for key, actions in by_policy[first].items():
        unique = list(dict.fromkeys(actions))
        if len(unique) > 2:
            key += f" (for {len(unique)} actions)"
        elif unique:
            key += f" (for {' and '.join(unique)})"
        problems.append(key)
    stmt = statement_of(source, first)
    label = policy_label(source, first, names)
    what = f"{label} does not validate against the schema: {'; '.join(problems)}"
    if stmt is not None:
        what = f"{source.where(source.locate_words(stmt, problems[0]))}: {what}"
    others = []
    for pid in pids[1:4]:
        other = statement_of(source, pid)
        place = source.where(other.start, column=False) if other is not None else pid
        others.append(f"{place} ({names[pid]})" if pid in names else place)
    if len(pids) > 1:
        more = f" and {len(pids) - 4} more" if len(pids) > 4 else ""
        what += f" (other policies that do not validate: {', '.join(others)}{more})"
    return InvalidRequest(what)
