"""Every fenced code block in README.md and docs/**/*.md runs, as a reader would run it.

The blocks of one page run in page order and share one session: a fresh ``SANDLOT_HOME``, a
working directory (with the checkout's ``docs/`` beside it, as in a checkout), the variables a
block exported, and a server once one was started. Each kind of block:

- ``python``: run by this interpreter in its own process, with ``tmp_path`` defined; tracebacks
  name the page and its line numbers. It passes when it raises nothing.
- ``console``: each ``$ `` line is a command run by bash; the lines after it are its expected
  standard output (an expected line starting ``error:`` or ``denied:`` means the command fails
  and that is its standard error). A command shown without output must succeed. Comparison
  ignores how whitespace and line breaks fall (the page wraps long lines) and treats as sample
  values: ids such as ``sb-3f9c2a7d1e04`` (bound to the id the first output showing one printed,
  or, first met in a command, to a sandbox the harness creates), numbers and hex digests (any
  number), and ``…`` (anything).
- ``sh``: each line is a command, run the same way, with no output to compare.
  ``sandlot serve`` lines start the server in the background.
- ``json`` is parsed (an ``mcpServers`` entry's command line must also be accepted), ``toml``
  rules and ``cedar`` policies are loaded by their engine, which validates them; any other
  ``toml`` is a ``sandlot.toml``, loaded as the settings it holds.
- ``text`` (diagrams, synopses) is not run; a block must say what it is.

``127.0.0.1:8470`` and the key ``sandlot_…`` stand for a server on a free port and an API key
the harness makes (or the block's own ``sandlot serve`` / ``sandlot api-keys create`` made).

A block that cannot run here is marked in the page, right before it, with
``<!-- example: skip (reason) -->``; the summary lists every skip. A command that fails
because of a defect someone is fixing is listed in :data:`KNOWN_DEFECTS` (the block is then an
expected failure; when the command works, the test fails until the entry is removed).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sandlot.policy import load_engine
from sandlot.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
BIN = Path(sys.executable).parent
MAX_SKIPS = 5
"""Skips stay rare: a new one must be argued for here."""

KNOWN_DEFECTS: dict[tuple[str, str], str] = {}
"""(page, the start of a command as written) -> the issue item fixing it."""

ID = r"(?:sb|snap|fork|ak)-[0-9a-f]{12}"
KEY_PLACEHOLDER = "sandlot_…"
PORT_PLACEHOLDER = "127.0.0.1:8470"
COMMAND_TIMEOUT = 300

# ------------------------------------------------------------------ reading the pages


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    """1-based line of the opening fence."""
    kind: str
    text: str
    skip: str | None = None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^<!--\s*example:\s*(?P<what>.*?)\s*-->$")
_SKIP = re.compile(r"^skip \((?P<reason>.+)\)$")


def read_blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page``, each with the skip marker right before it, if any."""
    lines = (ROOT / page).read_text().splitlines()
    out: list[Block] = []
    pending: str | None = None
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        marker = _MARKER.match(stripped)
        fence = _FENCE.match(lines[i])
        if marker:
            skip = _SKIP.match(marker["what"])
            if not skip:
                msg = f"{page}:{i + 1}: unknown example marker {stripped!r}"
                raise ValueError(msg)
            pending = skip["reason"].strip()
        elif fence:
            chars = fence["fence"]
            end = i + 1
            while end < len(lines) and not (
                lines[end].strip().startswith(chars) and not lines[end].strip().strip(chars[0])
            ):
                end += 1
            if end == len(lines):
                msg = f"{page}:{i + 1}: a code block that never ends"
                raise ValueError(msg)
            info = fence["info"].split()
            body = "\n".join(lines[i + 1 : end]) + "\n"
            out.append(Block(page, i + 1, info[0] if info else "", body, pending))
            pending = None
            i = end
        elif stripped and pending is not None:
            msg = f"{page}:{i + 1}: an example marker must come right before a code block"
            raise ValueError(msg)
        i += 1
    return out


ALL_BLOCKS = [b for page in PAGES for b in read_blocks(page)]
RUNNABLE = ("python", "console", "sh", "json", "toml", "cedar")
KNOWN_KINDS = (*RUNNABLE, "text")

# ------------------------------------------------------------------ prerequisites


def _local_missing() -> str | None:
    if os.geteuid() != 0:
        return "root (the local backend's sandboxes with allow-all networking)"
    for tool, package in (("crun", "crun"), ("nft", "nftables"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {package})"
    return None


def user_env(home: Path) -> dict[str, str]:
    """A user's environment: sandlot on PATH, a home of their own, no server configured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOT_")}
    if "SANDLOT_CACHE" in os.environ:
        env["SANDLOT_CACHE"] = os.environ["SANDLOT_CACHE"]
    env["SANDLOT_HOME"] = str(home)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


@functools.cache
def _pypi_missing() -> str | None:
    # Asked from a sandbox, where the example's pip runs: this host's own egress may differ.
    probe = "import socket; socket.create_connection(('pypi.org', 443), timeout=10).close()"
    with tempfile.TemporaryDirectory(prefix="sandlot-docs-probe-") as home:
        proc = subprocess.run(
            ["sandlot", "run", "--", "python3", "-c", probe],
            env=user_env(Path(home)),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    if proc.returncode == 0:
        return None
    reason = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return f"PyPI reachable from a sandbox (the example runs pip install: {reason})"


def prerequisite_missing(block: Block) -> str | None:
    """What this host lacks to run ``block`` (None: nothing)."""
    text = block.text
    uses_sandboxes = block.kind in ("console", "sh") or (
        block.kind == "python" and ("Sandlot(" in text or "Client(" in text)
    )
    if uses_sandboxes and "backends={" not in text:
        missing = _local_missing()
        if missing:
            return missing
    if re.search(r"pip install (?!.*--no-index)", text):
        return _pypi_missing()
    return None


# ------------------------------------------------------------------ comparing output

_TOKEN = re.compile(
    rf"(?P<id>\b{ID}\b)|(?P<any>…)|(?P<hex>\b(?=[0-9a-f]*\d)[0-9a-f]{{4,}}\b)|(?P<num>\d+)"
)


def _normal(text: str) -> str:
    return " ".join(text.split())


def expected_pattern(expected: str, bound: dict[str, str]) -> tuple[re.Pattern[str], list[str]]:
    """A regex for the whitespace-normalized output, and the placeholders its groups bind."""
    parts: list[str] = []
    binds: list[str] = []
    text = _normal(expected)
    pos = 0
    for m in _TOKEN.finditer(text):
        parts.append(re.escape(text[pos : m.start()]))
        pos = m.end()
        token = m.group()
        if m["id"]:
            if token in bound:
                parts.append(re.escape(bound[token]))
            elif token in binds:
                parts.append(f"(?P=g{binds.index(token)})")
            else:
                prefix = token.split("-")[0]
                parts.append(f"(?P<g{len(binds)}>{prefix}-[0-9a-f]{{12}})")
                binds.append(token)
        elif m["any"]:
            parts.append(".*?")
        elif m["hex"]:
            parts.append("[0-9a-f]+")
        else:
            parts.append(r"\d+")
    parts.append(re.escape(text[pos:]))
    return re.compile("".join(parts), re.DOTALL), binds


@dataclass
class Command:
    line: int
    text: str
    expected: list[str] = field(default_factory=list)


def console_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    continued = False
    for n, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        if continued:
            commands[-1].text += "\n" + raw
        elif raw.startswith("$ "):
            commands.append(Command(n, raw[2:]))
        elif commands:
            commands[-1].expected.append(raw)
        elif raw.strip():
            msg = f"{block.page}:{n}: console output before the first '$ ' command"
            raise ValueError(msg)
        continued = raw.endswith("\\") and (continued or raw.startswith("$ "))
    return commands


def sh_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    continued = False
    for n, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        if continued:
            commands[-1].text += "\n" + raw
        elif raw.strip() and not raw.lstrip().startswith("#"):
            commands.append(Command(n, raw))
        continued = raw.endswith("\\") and bool(commands)
    return commands


# ------------------------------------------------------------------ a page's session


class Failure(AssertionError):
    pass


@dataclass
class Ran:
    stdout: str
    stderr: str
    returncode: int


class Session:
    """What a reader of one page has: a home, a shell's state, perhaps a server."""

    def __init__(self, page: str, root: Path) -> None:
        self.page = page
        self.root = root
        self.cwd = root / "work"
        self.cwd.mkdir(parents=True)
        (self.cwd / "docs").symlink_to(ROOT / "docs")
        self.env = user_env(root / "home")
        self.port = _free_port()
        self.key: str | None = None
        self.server: subprocess.Popen[bytes] | None = None
        self.ran: dict[str, BaseException | None] = {}
        self._n = 0

    # -- running things

    def shell(self, command: str, *, timeout: float = COMMAND_TIMEOUT) -> Ran:
        """Run ``command`` in bash with the session's variables and directory; keep both."""
        self._n += 1
        state = self.root / f".state-{self._n}"
        script = (
            f"set -o pipefail\n{command}\n__rc=$?\n"
            f'{{ pwd; env -0; }} > {shlex.quote(str(state))}\nexit "$__rc"\n'
        )
        try:
            proc = subprocess.run(
                ["bash", "-c", script],
                cwd=self.cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            msg = f"`{command}` did not finish in {timeout} s"
            raise Failure(msg) from e
        if state.exists():
            cwd, _, env = state.read_text().partition("\n")
            self.cwd = Path(cwd)
            self.env = dict(entry.split("=", 1) for entry in env.split("\0") if "=" in entry)
            for name in ("__rc", "_", "SHLVL", "PWD", "OLDPWD"):
                self.env.pop(name, None)
            state.unlink()
        if "api-keys create" in command and (
            m := re.search(r"\bsandlot_[A-Za-z0-9_-]{20,}", proc.stdout)
        ):
            self.key = m.group()
        return Ran(proc.stdout, proc.stderr, proc.returncode)

    def sandlot(self, *args: str) -> str:
        ran = self.shell(shlex.join(["sandlot", *args]))
        if ran.returncode != 0:
            msg = f"sandlot {' '.join(args)} failed: {ran.stderr.strip()}"
            raise Failure(msg)
        return ran.stdout

    def serve(self, command: str) -> None:
        """Start ``sandlot serve …`` in the background and wait until it answers."""
        if self.server is not None:
            msg = f"{self.page}: a second server in one session"
            raise Failure(msg)
        with open(self.root / "server.log", "wb") as log:
            self.server = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                cwd=self.cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                tail = (self.root / "server.log").read_text()[-2000:]
                msg = f"`{command}` exited {self.server.returncode}: {tail}"
                raise Failure(msg)
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/healthz", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.2)
        msg = f"`{command}` did not answer /healthz in 60 s"
        raise Failure(msg)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ensure_server(self) -> None:
        if self.server is None:
            self.serve(f"sandlot serve --host 127.0.0.1 --port {self.port}")

    def ensure_key(self) -> str:
        if self.key is None:
            out = self.sandlot("api-keys", "create", "--tenant", "docs", "--json")
            self.key = str(json.loads(out)["key"])
        return self.key

    def substitute(self, text: str) -> str:
        """The block with the server and key placeholders made real."""
        serves = re.search(r"^(\$ )?sandlot serve\b", text, re.MULTILINE) is not None
        text = re.sub(r"--port 8470\b", f"--port {self.port}", text)
        if PORT_PLACEHOLDER in text:
            text = text.replace(PORT_PLACEHOLDER, f"127.0.0.1:{self.port}")
            if not serves:
                self.ensure_server()
        if KEY_PLACEHOLDER in text:
            text = text.replace(KEY_PLACEHOLDER, self.ensure_key())
        return text

    def close(self) -> None:
        """Destroy what the page left running (every tenant's), then stop the server."""
        try:
            self._destroy_all()
        finally:
            if self.server is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.server.pid, signal.SIGINT)
                try:
                    self.server.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.server.pid, signal.SIGKILL)
                    self.server.wait()

    def _destroy_all(self) -> None:
        if not (self.root / "home").exists():
            return
        env = user_env(self.root / "home")
        via_server = self.server is not None and self.server.poll() is None

        def sandlot(*args: str, tenant: str | None = None) -> str:
            run_env = dict(env)
            if via_server:
                # An admin key sees every tenant's sandboxes; only a tenant's own may act on them.
                key = self.sandlot(
                    "api-keys",
                    "create",
                    "--tenant",
                    tenant or "docs",
                    "--json",
                    *([] if tenant else ["--admin"]),
                )
                run_env.update(SANDLOT_URL=self.url, SANDLOT_API_KEY=json.loads(key)["key"])
            proc = subprocess.run(
                ["sandlot", *args],
                env=run_env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if proc.returncode != 0:
                msg = f"{self.page}: cleaning up, sandlot {' '.join(args)}: {proc.stderr.strip()}"
                raise Failure(msg)
            return proc.stdout

        for sb in json.loads(sandlot("list", "--json")):
            sandlot("destroy", sb["id"], tenant=sb["tenant"])
        assert json.loads(sandlot("list", "--json")) == [], f"{self.page} left sandboxes behind"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ runners


def run_python(session: Session, block: Block) -> None:
    source = session.root / f"block-{block.line}.py"
    # Padded so that a traceback's line numbers are the page's.
    source.write_text("\n" * block.line + session.substitute(block.text))
    tmp = session.root / f"tmp-{block.line}"
    tmp.mkdir()
    runner = (
        "import pathlib, sys\n"
        "code = compile(pathlib.Path(sys.argv[1]).read_text(), sys.argv[2], 'exec')\n"
        "exec(code, {'__name__': '__main__', 'tmp_path': pathlib.Path(sys.argv[3])})\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-W", "error", "-c", runner, str(source), block.page, str(tmp)],
            cwd=session.cwd,
            env=session.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        msg = f"did not finish in {COMMAND_TIMEOUT} s"
        raise Failure(msg) from e
    if proc.returncode != 0:
        msg = f"exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        raise Failure(msg)


def run_commands(session: Session, block: Block, commands: list[Command]) -> list[str]:
    """Run each command and check its output; the known defects that failed, as expected."""
    bound: dict[str, str] = {}
    known_failed: list[str] = []
    for cmd in commands:
        text = session.substitute(cmd.text)
        for placeholder in re.findall(rf"\b{ID}\b", text):
            if placeholder not in bound and placeholder.startswith("sb-"):
                # First met in a command: the reader has a sandbox of their own.
                bound[placeholder] = session.sandlot("create").strip()
        for placeholder, real in bound.items():
            text = text.replace(placeholder, real)
        defect = next(
            (
                why
                for (page, start), why in KNOWN_DEFECTS.items()
                if page == block.page and cmd.text.startswith(start)
            ),
            None,
        )
        try:
            check_command(session, cmd, text, bound)
        except Failure as e:
            if defect is None:
                raise
            known_failed.append(f"line {cmd.line}: {defect} ({str(e).splitlines()[0]})")
        else:
            if defect is not None:
                msg = (
                    f"line {cmd.line}: `{cmd.text}` works now; remove it from KNOWN_DEFECTS "
                    f"({defect})"
                )
                raise Failure(msg)
    return known_failed


def check_command(session: Session, cmd: Command, text: str, bound: dict[str, str]) -> None:
    where = f"line {cmd.line}: `{cmd.text}`"
    if re.match(r"sandlot serve\b", text):
        session.serve(text)
        return
    ran = session.shell(text)
    expected = "\n".join(cmd.expected)
    fails = _normal(expected).startswith(("error:", "denied:"))
    if fails != (ran.returncode != 0):
        msg = f"{where} exited {ran.returncode}\nstdout: {ran.stdout}\nstderr: {ran.stderr}"
        raise Failure(msg)
    if not cmd.expected:
        return
    actual = ran.stderr if fails else ran.stdout
    pattern, binds = expected_pattern(expected, bound)
    m = pattern.fullmatch(_normal(actual))
    if m is None:
        msg = f"{where} printed\n{actual}\nexpected (ids, numbers and … are samples)\n{expected}"
        raise Failure(msg)
    for i, placeholder in enumerate(binds):
        bound[placeholder] = m[f"g{i}"]


def run_json(session: Session, block: Block) -> None:
    data = json.loads(block.text)
    servers = data.get("mcpServers", {}) if isinstance(data, dict) else {}
    for name, server in servers.items():
        argv = [server["command"], *server.get("args", []), "--help"]
        env = {**session.env, **server.get("env", {})}
        proc = subprocess.run(
            argv, env=env, cwd=session.cwd, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            msg = (
                f"MCP server {name!r}: `{shlex.join(argv)}` exited {proc.returncode}: {proc.stderr}"
            )
            raise Failure(msg)


def run_toml(session: Session, block: Block) -> None:
    rules = tomllib.loads(block.text)
    if "rule" not in rules:
        # Not policy rules: a sandlot.toml, checked against the settings it may hold.
        path = session.root / f"sandlot-{block.line}.toml"
        path.write_text(block.text)
        load_settings(home=session.root, config=path, environ={})
        return
    path = session.root / f"rules-{block.line}.toml"
    path.write_text(block.text)
    load_engine({"engine": "builtin", "policy_paths": [str(path)]})


def run_cedar(session: Session, block: Block) -> None:
    path = session.root / f"policy-{block.line}.cedar"
    path.write_text(block.text)
    load_engine({"engine": "cedar", "policy_paths": [str(path)]})


def run_block(session: Session, block: Block) -> list[str]:
    """Run one block; the known defects that failed (the block is then an expected failure)."""
    if block.kind == "python":
        run_python(session, block)
    elif block.kind == "console":
        return run_commands(session, block, console_commands(block))
    elif block.kind == "sh":
        return run_commands(session, block, sh_commands(block))
    elif block.kind == "json":
        run_json(session, block)
    elif block.kind == "toml":
        run_toml(session, block)
    elif block.kind == "cedar":
        run_cedar(session, block)
    else:
        msg = f"no way to run a {block.kind!r} block: mark it <!-- example: skip (reason) -->"
        raise Failure(msg)
    return []


# ------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Session]]:
    made: dict[str, Session] = {}
    yield made
    with contextlib.ExitStack() as stack:  # every session is closed, whichever fails
        for s in made.values():
            stack.callback(s.close)


def _session(sessions: dict[str, Session], page: str, tmp: pytest.TempPathFactory) -> Session:
    if page not in sessions:
        sessions[page] = Session(page, tmp.mktemp(Path(page).stem))
    return sessions[page]


def _params() -> list[object]:
    return [pytest.param(b, id=b.name) for b in ALL_BLOCKS if b.kind != "text"]


@pytest.mark.timeout(3 * COMMAND_TIMEOUT)
@pytest.mark.parametrize("block", _params())
def test_example(block: Block, sessions, tmp_path_factory, docs_report) -> None:
    if block.skip:
        docs_report.record(block.name, block.kind, "skipped", block.skip)
        pytest.skip(block.skip)
    session = _session(sessions, block.page, tmp_path_factory)
    # A page is read from the top: the blocks before this one have run first.
    for earlier in ALL_BLOCKS:
        if earlier.page != block.page or earlier.line >= block.line:
            continue
        if earlier.name in session.ran or earlier.skip or earlier.kind == "text":
            continue
        if prerequisite_missing(earlier) is None:
            try:
                run_block(session, earlier)
                session.ran[earlier.name] = None
            except Exception as e:  # reported by that block's own test
                session.ran[earlier.name] = e
    missing = prerequisite_missing(block)
    if missing:
        docs_report.record(block.name, block.kind, "skipped", f"needs {missing}")
        pytest.skip(f"needs {missing}")
    started = time.monotonic()
    entry = docs_report.record(block.name, block.kind, "failed")
    try:
        known = run_block(session, block)
    except Exception as e:
        entry.why = (str(e).splitlines() or [type(e).__name__])[0]
        raise
    finally:
        entry.seconds = time.monotonic() - started
        session.ran[block.name] = None
    if known:
        entry.outcome, entry.why = "xfailed", "; ".join(known)
        pytest.xfail("; ".join(known))
    entry.outcome = "passed"


def test_every_block_says_what_it_is(docs_report) -> None:
    unknown = [
        f"{b.name} ({b.kind or 'no language'})"
        for b in ALL_BLOCKS
        if b.kind not in KNOWN_KINDS and not b.skip
    ]
    assert unknown == [], "tag each block with one of " + ", ".join(KNOWN_KINDS)
    for b in ALL_BLOCKS:
        if b.kind == "text":
            docs_report.record(b.name, b.kind, "not run", "text")


def test_skips_are_rare_and_say_why() -> None:
    skips = [(b.name, b.skip) for b in ALL_BLOCKS if b.skip is not None]
    assert all(reason and len(reason) > 10 for _, reason in skips), skips
    assert len(skips) <= MAX_SKIPS, skips


def test_the_harness_reads_what_the_pages_hold() -> None:
    pages = {b.page for b in ALL_BLOCKS}
    assert {"README.md", "docs/server.md", "docs/policies/README.md"} <= pages
    assert {b.kind for b in ALL_BLOCKS} >= {"python", "console", "sh", "json"}


def test_output_comparison() -> None:
    bound: dict[str, str] = {}
    pattern, binds = expected_pattern("sb-3f9c2a7d1e04", bound)
    m = pattern.fullmatch("sb-0123456789ab")
    assert m is not None
    assert binds == ["sb-3f9c2a7d1e04"]
    assert m["g0"] == "sb-0123456789ab"
    bound["sb-3f9c2a7d1e04"] = "sb-0123456789ab"
    same, _ = expected_pattern("sb-3f9c2a7d1e04 destroyed", bound)
    assert same.fullmatch("sb-0123456789ab destroyed")
    assert not same.fullmatch("sb-ffffffffffff destroyed")
    version, _ = expected_pattern("2.32.3", {})
    assert version.fullmatch("2.34.2")
    assert not version.fullmatch("two")
    wrapped, _ = expected_pattern("denied: a\nlong line (receipt sha256:9be1…)", {})
    assert wrapped.fullmatch(_normal("denied: a long line (receipt sha256:77aa0c3e)"))
    assert not wrapped.fullmatch("denied: another line (receipt sha256:77aa0c3e)")
    counts, _ = expected_pattern("OK: 1284 receipts verified", {})
    assert counts.fullmatch("OK: 37 receipts verified")
    assert not counts.fullmatch("FAIL: 37 receipts verified")


# ------------------------------------------------------------------ the harness itself fails

WRONG_EXAMPLES = [
    ("console", "$ echo hi\nho\n", "printed"),
    ("console", "$ false\n", "exited 1"),
    ("console", "$ echo fine\nerror: expected to fail\n", "exited 0"),
    (
        "console",
        "$ echo sb-0123456789ab; echo sb-0123456789ac\nsb-3f9c2a7d1e04\nsb-3f9c2a7d1e04\n",
        "printed",
    ),
    ("sh", 'export X=1\ntest "$X" = 2\n', "exited 1"),
    ("python", "raise SystemExit(3)\n", "exited 3"),
    ("python", "import warnings\nwarnings.warn('old', DeprecationWarning)\n", "DeprecationWarning"),
    ("json", '{"a": 1,}\n', "Expecting property name"),
    ("cedar", 'permit (principal, action, resource) when { context.progam == "rm" };\n', "progam"),
    ("toml", '[[rule]]\nid = "x"\neffect = "maybe"\n', "effect"),
    ("toml", '[server]\nport = "8470"\n', "[server] port: expected an integer"),
    ("rego", "package x\n", "no way to run"),
]


@pytest.mark.parametrize(("kind", "text", "says"), WRONG_EXAMPLES)
def test_a_wrong_example_fails(tmp_path: Path, kind: str, text: str, says: str) -> None:
    session = Session("wrong.md", tmp_path)
    with pytest.raises(Exception, match=re.escape(says)):
        run_block(session, Block("wrong.md", 1, kind, text))


def test_a_right_example_passes(tmp_path: Path) -> None:
    session = Session("right.md", tmp_path)
    text = "$ cd docs\n$ export X=sb-0123456789ab\n$ echo $X; pwd\nsb-3f9c2a7d1e04\n…/docs\n"
    assert run_block(session, Block("right.md", 1, "console", text)) == []


def test_a_known_defect_that_works_must_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = Session("known.md", tmp_path)
    monkeypatch.setitem(KNOWN_DEFECTS, ("known.md", "echo ok"), "issue 0")
    failing = Block("known.md", 1, "console", "$ echo ok\nnot ok\n")
    assert run_block(session, failing) == ["line 2: issue 0 (line 2: `echo ok` printed)"]
    with pytest.raises(Failure, match="works now"):
        run_block(session, Block("known.md", 1, "console", "$ echo ok\nok\n"))
