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

The shape of every context is documented in ``docs/policies/README.md``. This module holds the
walk over a command and the operations' contexts; what a command is read into is in
:mod:`~sandlot.policy.parsed`, wrapper unwrapping in :mod:`~sandlot.policy.wrappers`, one
program's arguments in :mod:`~sandlot.policy.program_args`. None of them may import engines,
the store, backends or front ends.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping, Sequence
from typing import Final

from pydantic import JsonValue, ValidationError

from sandlot.errors import InvalidRequest
from sandlot.models import CommandSpec, NetworkAllowlist, SandboxSpec
from sandlot.policy import limits, shell
from sandlot.policy.parsed import (
    _BRACE_WORDS,
    SHELLS,
    _Arg,
    _Cmd,
    _code_not_in_request,
    _is_device,
    _is_interpreter,
    _jl,
    _State,
    ancestors,
    normalize_path,
)
from sandlot.policy.program_args import (
    _dd_command,
    _generic_command,
    _table_command,
)
from sandlot.policy.programs import spec_for
from sandlot.policy.request import ACTIONS, ContextKind, PolicyRequest, Principal, Resource
from sandlot.policy.wrappers import (
    _WRAPPERS,
)

__all__ = [
    "ancestors",
    "normalize_command",
    "normalize_operation",
    "normalize_path",
]

# -- the walk ----------------------------------------------------------------------------------


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
