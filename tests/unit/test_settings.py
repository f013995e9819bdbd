"""sandlot.toml: precedence (flag > environment > file > default), one clear error for a bad
file, ``sandlot config show``, and the SDK and the CLI built from the same settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandlot.errors import InvalidRequest
from sandlot.sdk import AsyncSandlot
from sandlot.settings import load_settings
from sandlot.testing import FakeBackend

SANDLOT = [sys.executable, "-m", "sandlot"]


def sandlot(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SANDLOT, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        timeout=60,
    )


@pytest.fixture
def config_file(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    return home / "sandlot.toml"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- precedence ----------------------------------------------------------------------------------


def test_each_layer_overrides_the_one_below(config_file: Path, home: Path) -> None:
    assert load_settings(environ={}).values.backend is None
    assert load_settings(environ={}).source("backend") == "default"
    write(
        config_file, 'backend = "microvm"\ndatabase = "sqlite:///file.db"\n[server]\nport = 9001\n'
    )
    from_file = load_settings(environ={})
    assert (from_file.values.backend, from_file.source("backend")) == ("microvm", str(config_file))
    assert from_file.values.server.port == 9001
    assert from_file.values.server.host == "127.0.0.1"
    assert from_file.source("server.host") == "default"

    env = {"SANDLOT_BACKEND": "local", "SANDLOT_DATABASE_URL": "sqlite:///env.db"}
    from_env = load_settings(environ=env)
    assert (from_env.values.backend, from_env.source("backend")) == ("local", "env SANDLOT_BACKEND")
    assert from_env.values.database == "sqlite:///env.db"
    assert from_env.source("database") == "env SANDLOT_DATABASE_URL"
    assert from_env.values.server.port == 9001  # nothing above the file gives it

    flags = {
        "backend": ("fake", "flag --backend"),
        "database": ("sqlite:///flag.db", "flag --database"),
        "server.port": (9002, "flag --port"),
        "server.host": (None, "flag --host"),  # not given: no override
    }
    top = load_settings(environ=env, overrides=flags)
    assert (top.values.backend, top.source("backend")) == ("fake", "flag --backend")
    assert (top.values.database, top.source("database")) == ("sqlite:///flag.db", "flag --database")
    assert (top.values.server.port, top.source("server.port")) == (9002, "flag --port")
    assert (top.values.server.host, top.source("server.host")) == ("127.0.0.1", "default")


def test_policy_files_are_relative_to_the_file_and_the_environment_wins(
    config_file: Path, home: Path
) -> None:
    write(config_file, 'policy = ["strict.cedar", "/etc/extra.cedar"]\n')
    settings = load_settings(environ={})
    assert settings.values.policy == (str(home / "strict.cedar"), "/etc/extra.cedar")
    env = load_settings(environ={"SANDLOT_POLICY": "/a.cedar:/b.cedar"})
    assert env.values.policy == ("/a.cedar", "/b.cedar")
    assert env.source("policy") == "env SANDLOT_POLICY"


def test_the_file_is_found_by_flag_then_environment_then_home(
    config_file: Path, tmp_path: Path
) -> None:
    write(config_file, "[server]\nport = 1\n")
    elsewhere = write(tmp_path / "elsewhere.toml", "[server]\nport = 2\n")
    named = write(tmp_path / "named.toml", "[server]\nport = 3\n")
    assert load_settings(environ={}).values.server.port == 1
    by_env = load_settings(environ={"SANDLOT_CONFIG": str(elsewhere)})
    assert (by_env.values.server.port, by_env.config_source) == (2, "env SANDLOT_CONFIG")
    by_flag = load_settings(config=named, environ={"SANDLOT_CONFIG": str(elsewhere)})
    assert (by_flag.values.server.port, by_flag.config_source) == (3, "flag --config")
    assert by_flag.source("server.port") == str(named)
    with pytest.raises(InvalidRequest, match="no such configuration file"):
        load_settings(config=tmp_path / "missing.toml", environ={})


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[server]\nport = "abc"\n', '[server] port: expected an integer, got "abc"'),
        ("[server]\nprot = 8470\n", "[server] prot: unknown key"),
        ("[server]\nmcp = 1\n", "[server] mcp: expected true or false, got 1"),
        ("[backends.local.pool]\nnamespaces = -1\n", "[backends.local.pool] namespaces:"),
        ('[backends.local]\nisolation = "vm"\n', "[backends.local] isolation:"),
        ("[backends.qemu]\npool = 1\n", "[backends] qemu: unknown key"),
        ('backend = "warp"\n', "backend: unknown backend 'warp'"),
        ("server = 3\n", "server: expected a table, got 3"),
        ("port = \n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_one_error_naming_the_file_and_the_key(
    config_file: Path, text: str, message: str
) -> None:
    write(config_file, text)
    with pytest.raises(InvalidRequest) as caught:
        load_settings(environ={})
    assert caught.value.message.startswith(f"{config_file}: ")
    assert message in caught.value.message


def test_a_bad_flag_or_variable_is_named_as_such(config_file: Path) -> None:
    with pytest.raises(InvalidRequest, match=r'^--port: expected an integer, got "x"$'):
        load_settings(environ={}, overrides={"server.port": ("x", "flag --port")})
    with pytest.raises(InvalidRequest, match=r"^SANDLOT_BACKEND: unknown backend 'warp'"):
        load_settings(environ={"SANDLOT_BACKEND": "warp"})


def test_the_cli_prints_a_bad_file_as_one_line_and_exits_non_zero(config_file: Path) -> None:
    write(config_file, '[server]\nport = "abc"\n')
    for args in (("config", "show"), ("list",), ("serve",)):
        proc = sandlot(*args)
        assert proc.returncode == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines == [f'error: {config_file}: [server] port: expected an integer, got "abc"']
    as_json = sandlot("config", "show", "--json")
    assert as_json.returncode == 1
    assert "[server] port" in json.loads(as_json.stdout)["error"]["message"]


# -- config show ---------------------------------------------------------------------------------


def test_config_show_json_gives_every_value_and_its_source(
    config_file: Path, home: Path, tmp_path: Path
) -> None:
    write(
        config_file, 'backend = "fake"\n[server]\nport = 9100\n[backends.local.pool]\ngvisor = 2\n'
    )
    proc = sandlot(
        "--database",
        str(tmp_path / "flag.db"),
        "config",
        "show",
        "--json",
        env={"SANDLOT_POLICY": "/p.cedar"},
    )
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["home"] == {"value": str(home), "source": "env SANDLOT_HOME"}
    assert shown["config"] == {"value": str(config_file), "source": "default"}
    assert shown["backend"] == {"value": "fake", "source": str(config_file)}
    assert shown["database"] == {"value": str(tmp_path / "flag.db"), "source": "flag --database"}
    assert shown["policy"] == {"value": ["/p.cedar"], "source": "env SANDLOT_POLICY"}
    assert shown["server.port"] == {"value": 9100, "source": str(config_file)}
    assert shown["server.host"] == {"value": "127.0.0.1", "source": "default"}
    assert shown["backends.local.pool.gvisor"] == {"value": 2, "source": str(config_file)}
    assert shown["backends.local.pool.namespaces"] == {"value": 0, "source": "default"}
    assert shown["backends.microvm.pool"] == {"value": 0, "source": "default"}
    assert shown["server.mcp"] == {"value": True, "source": "default"}
    # Every setting the file may hold is listed.
    assert {"server.max_execs", "server.output_retention", "backends.local.isolation"} <= set(shown)

    table = sandlot("--backend", "local", "config", "show", env={"SANDLOT_BACKEND": "microvm"})
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("backend "))
    assert row.split() == ["backend", "local", "flag", "--backend"]


def test_config_show_never_prints_a_database_password(config_file: Path) -> None:
    write(config_file, 'database = "postgresql://sandlot:hunter2@db.example/sandlot"\n')
    proc = sandlot("config", "show", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "hunter2" not in proc.stdout
    assert json.loads(proc.stdout)["database"]["value"].startswith("postgresql://sandlot:***@")


# -- the same settings everywhere ----------------------------------------------------------------


async def test_the_sdk_reads_the_file_and_its_arguments_rank_as_flags(
    config_file: Path, tmp_path: Path
) -> None:
    db = tmp_path / "from-file.db"
    write(config_file, f'backend = "fake"\ndatabase = "{db}"\n')
    async with AsyncSandlot() as client:
        assert client.manager.default_backend == "fake"
        assert client.database_url == f"sqlite:///{db}"
        assert client.settings.source("backend") == str(config_file)
    async with AsyncSandlot(database=str(tmp_path / "arg.db")) as client:
        assert client.database_url == f"sqlite:///{tmp_path / 'arg.db'}"
        assert client.settings.source("database") == "argument database"


def test_the_cli_creates_on_the_files_backend(config_file: Path) -> None:
    write(config_file, 'backend = "fake"\n')
    proc = sandlot("create", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["backend"] == "fake"
    assert sandlot("destroy", info["id"]).returncode == 0


async def test_the_files_local_isolation_is_the_default_a_spec_may_override(
    config_file: Path,
) -> None:
    write(config_file, '[backends.local]\nisolation = "gvisor"\n')
    # A fake standing in for the local backend: the Manager's defaulting is what is tested.
    async with AsyncSandlot(backends={"local": FakeBackend()}) as client:
        plain = await client.create()
        assert plain.info.backend == "local"
        assert plain.info.spec.backend_options == {"local": {"isolation": "gvisor"}}
        chosen = await client.create(backend_options={"local": {"isolation": "namespaces"}})
        assert chosen.info.spec.backend_options == {"local": {"isolation": "namespaces"}}
        both = await client.create(backend_options={"microvm": {}, "local": {}})
        assert both.info.spec.backend_options["local"] == {"isolation": "gvisor"}
    write(config_file, "")
    async with AsyncSandlot(backends={"local": FakeBackend()}) as client:
        assert (await client.create()).info.spec.backend_options == {}


def test_reading_settings_loads_nothing_heavy() -> None:
    """Every command reads its settings first: that must not cost the database layer, the
    crypto or the Manager (the wiring imports them only where it builds them)."""
    code = (
        "import sys, sandlot.settings, sandlot.wiring\n"
        "heavy = ['sqlalchemy', 'cryptography', 'cedarpy', 'sandlot.manager', 'sandlot.store',"
        " 'sandlot.receipts', 'sandlot.journal']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip() == "[]"


def test_pool_tables_become_the_backends_constructor_options(config_file: Path) -> None:
    from sandlot.wiring import backend_config

    assert backend_config(load_settings(environ={})) == {}  # unconfigured: built as before
    write(
        config_file,
        "[backends.local.pool]\nnamespaces = 2\ngvisor = 1\n[backends.microvm]\npool = 3\n",
    )
    assert backend_config(load_settings(environ={})) == {
        "local": {"pool": {"namespaces": 2, "gvisor": 1}},
        "microvm": {"pool_size": 3},
    }
