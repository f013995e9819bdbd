"""The CLI as a user runs it: the real console script, one process per command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SANDLOT = [sys.executable, "-m", "sandlot"]


def sandlot(
    *args: str, stdin: str | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SANDLOT_BACKEND": "fake", "COLUMNS": "200"}
    proc = subprocess.run(
        [*SANDLOT, *args], input=stdin, capture_output=True, text=True, env=env, timeout=60
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_create_list_get_exec_destroy_across_invocations() -> None:
    created = sandlot(
        "create", "--label", "team=a", "--setup", "echo preparing", "--json", check=True
    )
    info = json.loads(created.stdout)
    assert {"id", "status", "backend"} <= info.keys()
    assert (info["status"], info["backend"]) == ("running", "fake")
    sid = info["id"]

    listed = json.loads(sandlot("list", "--json", check=True).stdout)
    assert [s["id"] for s in listed] == [sid]
    assert sid in sandlot("list", check=True).stdout
    assert json.loads(sandlot("list", "--label", "team=b", "--json", check=True).stdout) == []

    ran = sandlot("exec", sid, "--", "echo", "hello world")
    assert (ran.returncode, ran.stdout) == (0, "hello world\n")
    assert sandlot("exec", sid, "--", "false").returncode == 1
    assert sandlot("exec", sid, "--shell", "--", "exit 7").returncode == 7
    as_json = json.loads(sandlot("exec", sid, "--json", "--", "echo", "x").stdout)
    assert as_json["exit_code"] == 0

    sandlot("write-file", sid, "/workspace/in.txt", "-", stdin="data\n", check=True)
    assert sandlot("read-file", sid, "/workspace/in.txt", check=True).stdout == "data\n"
    files = json.loads(sandlot("list-files", sid, "--json", check=True).stdout)
    assert [f["name"] for f in files] == ["in.txt"]

    assert "stopped" in sandlot("stop", sid, check=True).stdout
    assert "running" in sandlot("resume", sid, check=True).stdout
    destroyed = json.loads(sandlot("destroy", sid, "--json", check=True).stdout)
    assert destroyed["status"] == "destroyed"
    assert destroyed["death"]["cause"] == "destroyed"
    assert json.loads(sandlot("list", "--json", check=True).stdout) == []
    assert [s["id"] for s in json.loads(sandlot("list", "--all", "--json", check=True).stdout)] == [
        sid
    ]


def test_run_exits_with_the_commands_code_and_leaves_nothing() -> None:
    ok = sandlot("run", "--", "echo", "once")
    assert (ok.returncode, ok.stdout) == (0, "once\n")
    bad = sandlot("run", "--shell", "--", "exit 5")
    assert bad.returncode == 5
    remaining = json.loads(sandlot("list", "--json", check=True).stdout)
    assert remaining == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("get", "sb-nope"), "no sandbox 'sb-nope'"),
        (("create", "--env", "1BAD=x"), "env: '1BAD' is not a valid environment variable name"),
        (("create", "--port", "70000"), "ports: 70000 is outside 1..65535"),
        (("create", "--workdir", "rel"), "workdir: must be an absolute path"),
        (("create", "--timeout", "-5"), "timeout: must be a positive number"),
        (("create", "--deny-cidr", "10.0.0.0/33"), "'10.0.0.0/33' is not a valid CIDR"),
        (
            ("create", "--network", "sometimes"),
            "network: must be 'allow-all', 'deny-all' or an allowlist",
        ),
        (("create", "--label", "novalue"), "--label expects KEY=VALUE"),
        (("create", "--spec", "/does/not/exist.json"), "--spec: cannot read"),
        (("exec", "sb-nope", "--", "true"), "no sandbox 'sb-nope'"),
        (("--backend", "warp", "create"), "unknown backend 'warp'"),
        (("create", "--backend", "warp"), "unknown backend 'warp'"),
        (("run", "--backend", "warp", "--", "true"), "unknown backend 'warp'"),
    ],
)
def test_bad_input_is_one_clear_line_no_traceback(args: tuple[str, ...], message: str) -> None:
    proc = sandlot(*args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_create_and_run_take_backend_after_the_command() -> None:
    """Issue 14: `sandlot create --backend X` said "No such option: --backend"; only the
    global `sandlot --backend X create` worked. The command's own option wins over it."""
    info = json.loads(
        sandlot("--backend", "local", "create", "--backend", "fake", "--json", check=True).stdout
    )
    assert info["backend"] == "fake"
    ran = sandlot("--backend", "local", "run", "-b", "fake", "--json", "--", "echo", "hi")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["result"]["stdout"] == "hi\n"


def test_errors_as_json() -> None:
    proc = sandlot("get", "sb-nope", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"]["code"] == "not_found"


def test_spec_file(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text('workdir = "/src"\nsetup = ["echo a"]\n[labels]\nfrom = "file"\n')
    info = json.loads(
        sandlot("create", "--spec", str(spec), "--label", "extra=1", "--json", check=True).stdout
    )
    assert info["spec"]["workdir"] == "/src"
    assert info["spec"]["labels"] == {"from": "file", "extra": "1"}


def test_setup_failure_reports_and_get_shows_the_death_certificate() -> None:
    proc = sandlot("create", "--setup", "echo compiling", "--setup", "exit 2")
    assert proc.returncode == 1
    assert "setup step 2 exited with 2" in proc.stderr
    (sb,) = json.loads(sandlot("list", "--status", "failed", "--json", check=True).stdout)
    shown = sandlot("get", sb["id"], check=True).stdout
    assert "setup_failed" in shown
    assert "compiling" in shown


def test_help_and_version() -> None:
    assert "sandlot" in sandlot("--version", check=True).stdout
    help_text = sandlot("--help", check=True).stdout
    for command in ("create", "list", "exec", "run", "logs", "doctor", "reconcile", "fork"):
        assert command in help_text


def test_doctor_json() -> None:
    proc = sandlot("doctor", "--json")
    report = json.loads(proc.stdout)
    assert report["backends"]["fake"]["usable"] is True
    assert {c["name"] for c in report["checks"]["general"]} >= {
        "python",
        "state directory",
        "database",
    }


@pytest.mark.parametrize(
    "args",
    [
        ("create", "--port", "abc", "--json"),
        ("exec", "--json"),
        ("list", "--bogus", "--json"),
    ],
)
def test_a_usage_error_with_json_is_a_json_error(args: tuple[str, ...]) -> None:
    """Issue 13 item 16: usage errors printed usage text even with --json."""
    proc = sandlot(*args)
    assert proc.returncode == 2
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == "usage"
    assert error["message"]
    assert "Traceback" not in proc.stderr


def test_api_keys_list_shows_whole_ids_on_a_narrow_terminal() -> None:
    made = json.loads(
        sandlot("api-keys", "create", "--tenant", "acme", "--json", check=True).stdout
    )
    key_id = made["info"]["id"] if "info" in made else made["id"]
    env_narrow = {**os.environ, "SANDLOT_BACKEND": "fake", "COLUMNS": "60"}
    listed = subprocess.run(
        [*SANDLOT, "api-keys", "list"], capture_output=True, text=True, env=env_narrow, timeout=60
    )
    assert key_id in listed.stdout
    assert sandlot("api-keys", "revoke", key_id).returncode == 0


def test_a_retried_exec_prints_the_output_again() -> None:
    sid = json.loads(sandlot("create", "--json", check=True).stdout)["id"]
    first = sandlot("exec", "--idempotency-key", "k-1", sid, "--", "echo", "once")
    again = sandlot("exec", "--idempotency-key", "k-1", sid, "--", "echo", "once")
    assert (first.returncode, first.stdout) == (0, "once\n")
    assert (again.returncode, again.stdout) == (0, "once\n")


def test_a_running_sandbox_shows_no_stale_cause_of_death() -> None:
    sid = json.loads(sandlot("create", "--json", check=True).stdout)["id"]
    sandlot("stop", sid, check=True)
    sandlot("resume", sid, check=True)
    shown = sandlot("get", sid, check=True).stdout
    assert "running" in shown
    assert "cause" not in shown
    assert json.loads(sandlot("get", sid, "--json", check=True).stdout)["death"] is None


def test_ctrl_c_during_create_leaves_nothing() -> None:
    """Issue 13 item 2: Ctrl-C late in a create left a running sandbox nobody was told of."""
    import signal
    import time

    env = {**os.environ, "SANDLOT_BACKEND": "fake", "COLUMNS": "200"}
    proc = subprocess.Popen(
        [*SANDLOT, "create", "--setup", "sleep 30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = sandlot("list", "--all", "--json")
        if listed.returncode == 0 and json.loads(listed.stdout):
            break  # the record exists: the create is under way
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert "Traceback" not in err
    (record,) = json.loads(sandlot("list", "--all", "--json", check=True).stdout)
    assert record["status"] == "destroyed"
    assert record["death"]["cause"] == "interrupted"
    assert out == ""


def test_list_offers_every_status_by_its_value() -> None:
    """`list --status` offers the CLI's own copy of the statuses (the wire models are not
    imported to build the command line); it must be the same list."""
    from sandlot.cli.options import StatusName
    from sandlot.models import SandboxStatus

    assert [s.value for s in StatusName] == [s.value for s in SandboxStatus]


# What a start-up must not pay for: `--version` imports nothing but the version (not even
# typing, most of what is left), and `--help` builds the whole command line without the
# SDK, the store, pydantic or anyio.
_IMPORTED = (
    "import sys; from sandlot.cli import main; sys.argv[1:] = {args!r}\n"
    "try:\n    main()\nexcept SystemExit:\n    pass\n"
    "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {names!r})))"
)


@pytest.mark.parametrize(
    ("args", "allowed", "heavy"),
    [
        (["--version"], {"sandlot", "sandlot._version", "sandlot.cli"}, set()),
        (["--help"], None, {"pydantic", "sqlalchemy", "anyio", "httpx", "cryptography"}),
        # typer itself brings pydantic in to parse the global options before a subcommand.
        (["exec", "--help"], None, {"sqlalchemy", "anyio", "httpx", "cryptography"}),
    ],
)
def test_a_quick_command_imports_only_what_it_needs(
    args: list[str], allowed: set[str] | None, heavy: set[str]
) -> None:
    names = {
        "sandlot",
        "typer",
        "typing",
        "pydantic",
        "sqlalchemy",
        "anyio",
        "httpx",
        "cryptography",
    }
    code = _IMPORTED.format(args=args, names=names)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    imported = set(proc.stdout.splitlines()[-1].split())
    if allowed is not None:
        assert imported == allowed
        return
    assert not {m.split(".")[0] for m in imported} & heavy
    assert {m for m in imported if m.startswith("sandlot.")} <= {
        "sandlot._version",
        "sandlot.errors",
        *(m for m in imported if m.startswith("sandlot.cli")),
    }
    assert "sandlot.cli.doctor" not in imported


def test_the_command_table_names_each_commands_module() -> None:
    """A command line that names a command loads only its module (typer builds every
    registered command on each start); the table saying which module that is must match
    what the modules register, or a command would go missing."""
    code = (
        "import json; from sandlot.cli import app as m\n"
        "m.load_commands()\n"
        "found = {}\n"
        "for c in m.app.registered_commands:\n"
        "    name = c.name or c.callback.__name__.replace('_', '-')\n"
        "    found[name] = c.callback.__module__.rpartition('.')[2]\n"
        "for g in m.app.registered_groups:\n"
        "    cb = g.typer_instance.registered_commands[0].callback\n"
        "    found[g.name] = cb.__module__.rpartition('.')[2]\n"
        "found['doctor'] = 'doctor'\n"
        "print(json.dumps([found, m.COMMANDS, list(m.MODULES)]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    found, table, modules = json.loads(proc.stdout)
    assert found == table
    assert set(table.values()) == set(modules)
    # And each command works when it is the only module loaded (one per module here).
    assert sandlot("list", "--json", check=True).stdout.strip() == "[]"
    assert "checks" in json.loads(sandlot("--backend", "fake", "doctor", "--json").stdout)
    assert sandlot("intents", "list", "--json", check=True).stdout.strip() == "[]"
