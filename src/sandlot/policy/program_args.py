"""Reading one program's arguments: flags to canonical names and paths with the program's
table (:mod:`sandlot.policy.programs`), and the programs that need a reader of their own
(``dd``; ``find`` runs commands, so it is read with the walk).

Part of :mod:`sandlot.policy.normalize`. Must not import engines, the store, backends or front
ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from sandlot.policy.parsed import (
    _Arg,
    _Cmd,
    _pathlike,
    _State,
)
from sandlot.policy.programs import ProgramSpec

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
