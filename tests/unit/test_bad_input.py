"""Bad settings as a user gives them: a database that cannot be reached or made, a value that
names nothing, an unknown backend option, an accelerator that cannot work. Each is one line on
stderr (or a JSON error object with ``--json``) naming the fix, exit code 1, never a traceback,
and never a URL's password."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.image import ImagePaths
from sandlot.backends.options import BACKEND_OPTIONS
from sandlot.backends.registry import BACKEND_NAMES
from sandlot.errors import BackendUnavailable, InvalidRequest
from sandlot.sdk import database_url
from sandlot.store.connect import redact_url

SECRET = "s3cret-pw"
REFUSED = f"postgresql://sandlot:{SECRET}@127.0.0.1:1/x"
"""Nothing listens on port 1: the connection is refused at once."""


def sandlot(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, python: str = ""
) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process; ``python`` runs first in it (to take psycopg away)."""
    full_env = {**os.environ, "SANDLOT_BACKEND": "fake", "COLUMNS": "200", **(env or {})}
    boot = f"{python}\nimport runpy; runpy.run_module('sandlot', run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", boot, *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=60,
        check=False,
    )


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a failed command."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    return lines[0]


def json_error(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    error = json.loads(proc.stdout)["error"]
    assert isinstance(error, dict)
    return error


# -- the database: unreachable, unopenable, not installed ---------------------------------


def test_an_unreachable_postgresql_is_one_line_naming_the_fix() -> None:
    expected = "cannot reach PostgreSQL at 127.0.0.1:1 (connection refused); is the server running?"
    assert one_line(sandlot("--database", REFUSED, "list")) == f"error: {expected}"
    error = json_error(sandlot("--database", REFUSED, "list", "--json"))
    assert (error["code"], error["message"]) == ("backend_unavailable", expected)
    # The environment variable takes the same path.
    env = {"SANDLOT_DATABASE_URL": REFUSED}
    assert one_line(sandlot("create", env=env)) == f"error: {expected}"


@pytest.mark.parametrize(
    ("database", "message"),
    [
        (
            "/proc/x.db",
            "cannot open the SQLite database /proc/x.db: /proc does not accept new files; "
            "choose another path with --database or SANDLOT_DATABASE_URL",
        ),
        (
            "sqlite:////nonexistent-dir/x.db",
            "cannot open the SQLite database /nonexistent-dir/x.db: directory /nonexistent-dir "
            "does not exist; choose another path with --database or SANDLOT_DATABASE_URL",
        ),
        (
            "/etc/passwd",
            "/etc/passwd is not a SQLite database; "
            "choose another path with --database or SANDLOT_DATABASE_URL",
        ),
    ],
)
def test_an_unusable_sqlite_file_is_one_line(database: str, message: str) -> None:
    assert one_line(sandlot("--database", database, "list")) == f"error: {message}"
    error = json_error(sandlot("--database", database, "list", "--json"))
    assert (error["code"], error["message"]) == ("invalid_request", message)


def test_a_read_only_directory_is_one_line(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    mounted = False
    if os.geteuid() == 0:
        # Root writes into any directory its mode forbids; a read-only mount stops it too.
        subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
        mounted = True
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
    try:
        message = (
            f"cannot open the SQLite database {ro / 'x.db'}: directory {ro} is not writable "
            "(SQLite keeps its journal beside the file); "
            "choose another path with --database or SANDLOT_DATABASE_URL"
        )
        assert one_line(sandlot("--database", str(ro / "x.db"), "list")) == f"error: {message}"
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)


BLOCK_PSYCOPG = "import sys; sys.modules['psycopg'] = None"
"""What a Python without psycopg does on ``import psycopg``: ModuleNotFoundError."""
NOT_INSTALLED = "PostgreSQL support is not installed: pip install 'sandlot[postgres]'"


def test_postgresql_without_psycopg_is_one_line_naming_the_install() -> None:
    proc = sandlot("--database", "postgresql://127.0.0.1/test", "list", python=BLOCK_PSYCOPG)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    error = json_error(
        sandlot("--database", "postgresql://127.0.0.1/test", "list", "--json", python=BLOCK_PSYCOPG)
    )
    assert (error["code"], error["message"]) == ("backend_unavailable", NOT_INSTALLED)
    # SQLite needs no psycopg at all.
    assert sandlot("list", python=BLOCK_PSYCOPG).returncode == 0


def test_the_install_hint_is_printed_as_written() -> None:
    proc = sandlot("--database", "postgresql://127.0.0.1/test", "list", python=BLOCK_PSYCOPG)
    assert one_line(proc) == f"error: {NOT_INSTALLED}"


def test_doctor_reports_the_database_as_a_failed_check() -> None:
    proc = sandlot("--database", REFUSED, "doctor", "--json")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    (db,) = [c for c in json.loads(proc.stdout)["checks"]["general"] if c["name"] == "database"]
    assert db["ok"] is False
    assert db["detail"] == (
        "cannot reach PostgreSQL at 127.0.0.1:1 (connection refused); is the server running?"
    )
    plain = sandlot("--database", "postgresql://127.0.0.1/test", "doctor", python=BLOCK_PSYCOPG)
    assert plain.returncode == 1
    assert "Traceback" not in plain.stderr
    assert "pip install 'sandlot[postgres]'" in " ".join(plain.stdout.split())


def test_serve_on_an_unreachable_database_is_one_line() -> None:
    line = one_line(sandlot("serve", "--port", "0", "--database", REFUSED))
    assert line == (
        "error: cannot reach PostgreSQL at 127.0.0.1:1 (connection refused); is the server running?"
    )


# -- the database: values that name nothing ------------------------------------------------

FORMS = (
    "use sqlite:///PATH, postgresql://USER@HOST:PORT/DATABASE, "
    "or a SQLite file path ending in .db, .sqlite or .sqlite3"
)


def test_a_bare_word_is_refused_instead_of_becoming_a_file(tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    message = f"database 'garbage' is neither a URL nor a SQLite file; {FORMS}"
    assert one_line(sandlot("--database", "garbage", "list", cwd=cwd)) == f"error: {message}"
    error = json_error(sandlot("--database", "garbage", "list", "--json", cwd=cwd))
    assert (error["code"], error["message"]) == ("invalid_request", message)
    env = {"SANDLOT_DATABASE_URL": "garbage"}
    assert one_line(sandlot("list", cwd=cwd, env=env)) == f"error: {message}"
    assert list(cwd.iterdir()) == []


def test_the_accepted_forms_of_a_sqlite_database(tmp_path: Path, home: Path) -> None:
    assert database_url("state.sqlite3", home) == f"sqlite:///{Path.cwd() / 'state.sqlite3'}"
    kept = tmp_path / "records"  # no suffix, but it exists: a database made earlier
    kept.touch()
    assert database_url(str(kept), home) == f"sqlite:///{kept}"
    assert database_url(f"sqlite:///{tmp_path / 'any-name'}", home).endswith("/any-name")
    assert database_url(None, home) == f"sqlite:///{home / 'sandlot.db'}"
    for bad in ("postgres:/db", "", "127.0.0.1:5432"):
        with pytest.raises(InvalidRequest):
            database_url(bad, home)
    with pytest.raises(InvalidRequest, match="is a directory"):
        database_url(str(tmp_path), home)
    assert sandlot("--database", str(tmp_path / "new.db"), "list", cwd=tmp_path).returncode == 0
    assert (tmp_path / "new.db").is_file()


def test_an_unknown_scheme_names_the_supported_ones_and_no_password() -> None:
    message = (
        "unsupported database URL scheme 'mysql://': sandlot stores its records in SQLite "
        "(sqlite:///PATH) or PostgreSQL (postgresql://…, postgres://…, postgresql+psycopg://…)"
    )
    url = f"mysql://root:{SECRET}@db/x"
    assert one_line(sandlot("--database", url, "list")) == f"error: {message}"
    error = json_error(sandlot("--database", url, "list", "--json"))
    assert (error["code"], error["message"]) == ("invalid_request", message)


def test_redacted_urls_keep_everything_but_the_password() -> None:
    assert redact_url(f"postgresql://u:{SECRET}@h:5/db") == "postgresql://u:***@h:5/db"
    assert redact_url(f"postgresql://h/db?password={SECRET}") == "postgresql://h/db?password=***"
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert SECRET not in redact_url(f"postgresql://u:{SECRET}@[::1/db")


def test_a_home_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.touch()
    line = one_line(sandlot("list", env={"SANDLOT_HOME": str(blocker)}))
    assert line == (
        f"error: cannot use the state directory {blocker} (a file is in the way); "
        "set --home or SANDLOT_HOME to a writable directory"
    )


# -- backend options ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "nosuch.key=1",
            "--option nosuch.key: unknown backend 'nosuch' (known: fake, local, microvm)",
        ),
        (
            "local.nosuch=1",
            "--option local.nosuch: the local backend has no option 'nosuch' (its options: enforcement, hidden_paths, isolation, protected_paths)",
        ),
        (
            "microvm.vcpus=2",
            "--option microvm.vcpus: the microvm backend has no option 'vcpus' (it takes no options)",
        ),
        (
            "local.isolation=vm",
            "--option local.isolation must be one of namespaces, gvisor, got 'vm'",
        ),
    ],
)
def test_an_unknown_backend_option_is_refused_naming_the_known_ones(
    option: str, message: str
) -> None:
    # On the fake backend too: a spec carrying another backend's options must still make sense.
    assert one_line(sandlot("create", "-o", option)) == f"error: {message}"
    error = json_error(sandlot("create", "-o", option, "--json"))
    assert (error["code"], error["message"]) == ("invalid_request", message)


def test_a_spec_files_backend_options_are_checked_too(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"backend_options": {"locl": {"isolation": "gvisor"}}}))
    assert one_line(sandlot("create", "--spec", str(spec))) == (
        "error: --spec: backend_options.locl: unknown backend 'locl' (known: fake, local, microvm)"
    )
    spec.write_text(json.dumps({"backend_options": {"local": {"isolation": "gvisor"}}}))
    created = sandlot("create", "--spec", str(spec), "-o", "local.isolation=namespaces", "--json")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["spec"]["backend_options"] == {
        "local": {"isolation": "namespaces"}
    }


def test_every_backend_declares_its_options() -> None:
    assert set(BACKEND_OPTIONS) == set(BACKEND_NAMES)


# -- the microVM accelerator -------------------------------------------------------------


def _image(tmp_path: Path) -> ImagePaths:
    return ImagePaths(
        tmp_path, tmp_path / "bzImage", tmp_path / "initrd", tmp_path / "disk", "raw", "", "key"
    )


def _cache_probe(cache: Path, image: ImagePaths, *, works: bool) -> None:
    """A probe answer in the cache, as an earlier run on this host boot left it."""
    path = cache / "microvm" / "kvm-probe.json"
    path.parent.mkdir(parents=True)
    reason = "a probe boot under KVM failed: QEMU said no; using TCG emulation"
    mode = "tcg"
    if works:
        reason, mode = "a probe boot under KVM reached the guest in 0.50 s", "kvm"
    path.write_text(json.dumps({"key": qemu._probe_key(image), "mode": mode, "reason": reason}))


@pytest.mark.parametrize("value", ["bogus", "KVM-please", "1"])
def test_a_bogus_accelerator_is_refused_naming_kvm_and_tcg(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_MICROVM_ACCEL", value)
    with pytest.raises(InvalidRequest) as caught:
        qemu.decide_accel(_image(tmp_path), tmp_path)
    assert caught.value.message == (
        f"SANDLOT_MICROVM_ACCEL must be kvm or tcg (or unset, to let sandlot probe), got {value!r}"
    )
    check = qemu.accel_check(_image(tmp_path), tmp_path)
    assert (check.ok, check.detail) == (False, caught.value.message)
    # With no guest image built yet the setting is still checked.
    check = qemu.accel_check(None, tmp_path)
    assert (check.ok, check.detail) == (False, caught.value.message)


def test_the_accelerator_setting_is_case_and_blank_tolerant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_MICROVM_ACCEL", " TCG ")
    assert qemu.decide_accel(_image(tmp_path), tmp_path).mode == "tcg"
    monkeypatch.setenv("SANDLOT_MICROVM_ACCEL", "")
    assert qemu.forced_accel() is None


def test_forcing_kvm_where_the_probe_failed_is_refused_before_any_vm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _image(tmp_path)
    _cache_probe(tmp_path, image, works=False)
    monkeypatch.setenv("SANDLOT_MICROVM_ACCEL", "kvm")
    with pytest.raises(BackendUnavailable) as caught:
        qemu.decide_accel(image, tmp_path)
    why = (
        "a probe boot under KVM failed: QEMU said no"
        if os.access("/dev/kvm", os.R_OK | os.W_OK)
        else "/dev/kvm is absent or not accessible"
    )
    assert caught.value.message == (
        f"SANDLOT_MICROVM_ACCEL=kvm, but KVM cannot run a guest on this host ({why}); "
        "unset it to let sandlot use TCG, or set it to tcg"
    )
    check = qemu.accel_check(image, tmp_path)
    assert (check.name, check.ok, check.detail) == ("accelerator", False, caught.value.message)
    # Unforced, the same answer means TCG, as before.
    monkeypatch.delenv("SANDLOT_MICROVM_ACCEL")
    assert qemu.decide_accel(image, tmp_path).mode == "tcg"


def test_forcing_kvm_where_the_probe_worked_uses_kvm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        pytest.skip("needs an accessible /dev/kvm (the probe's answer is read only then)")
    image = _image(tmp_path)
    _cache_probe(tmp_path, image, works=True)
    monkeypatch.setenv("SANDLOT_MICROVM_ACCEL", "kvm")
    decision = qemu.decide_accel(image, tmp_path)
    assert decision.mode == "kvm"
    assert decision.reason.startswith("set by SANDLOT_MICROVM_ACCEL; a probe boot under KVM")


def _built_image() -> ImagePaths:
    from sandlot.backends.microvm.image import find_cached_image

    if shutil.which(qemu.QEMU_BINARY) is None:
        pytest.skip(f"needs {qemu.QEMU_BINARY} (apt-get install qemu-system-x86)")
    image = find_cached_image()
    if image is None:
        pytest.skip("needs a built microvm guest image (sandlot images build microvm)")
    return image


def test_a_bogus_accelerator_fails_a_microvm_create_and_the_doctor_in_one_line() -> None:
    _built_image()
    env = {"SANDLOT_MICROVM_ACCEL": "bogus"}
    line = one_line(sandlot("-b", "microvm", "create", "--network", "deny-all", env=env))
    assert line.startswith(
        "error: SANDLOT_MICROVM_ACCEL must be kvm or tcg (or unset, to let sandlot probe), "
        "got 'bogus'"
    )
    doctor = json.loads(sandlot("doctor", "--json", env=env).stdout)
    assert doctor["backends"]["microvm"]["usable"] is False
    assert any(
        not c["ok"] and "must be kvm or tcg" in c["detail"] for c in doctor["checks"]["microvm"]
    )


def test_forced_kvm_on_a_host_whose_kvm_cannot_run_a_guest_fails_fast() -> None:
    image = _built_image()
    works, why, _ = qemu._kvm_works(image, None)  # the real probe (or its cached answer)
    if works:
        pytest.skip("KVM runs guests on this host: forcing it is fine")
    env = {"SANDLOT_MICROVM_ACCEL": "kvm"}
    expected = (
        f"error: SANDLOT_MICROVM_ACCEL=kvm, but KVM cannot run a guest on this host ({why}); "
        "unset it to let sandlot use TCG, or set it to tcg"
    )
    started = time.monotonic()
    line = one_line(sandlot("-b", "microvm", "create", "--network", "deny-all", env=env))
    assert time.monotonic() - started < 30
    assert line.startswith(expected)
    doctor = sandlot("doctor", "--json", env=env)
    report = json.loads(doctor.stdout)
    assert report["backends"]["microvm"]["usable"] is False
    assert any(c["detail"] == expected.removeprefix("error: ") for c in report["checks"]["microvm"])


# -- git options with nothing to clone ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--git-revision", "main"), "--git-revision needs"),
        (("--git-depth", "1", "--git-revision", "v2"), "--git-revision and --git-depth need"),
        (("--git-auth", "Bearer x"), "--git-auth needs"),
    ],
)
def test_git_options_without_a_repository_are_refused(args: tuple[str, ...], message: str) -> None:
    line = one_line(sandlot("create", *args))
    assert (
        line == f"error: {message} a repository to clone: add --git URL (or a --spec file with git)"
    )


def test_git_options_apply_to_the_spec_files_repository(tmp_path: Path) -> None:
    # $SANDLOT_GIT_AUTH is ambient: a create that clones nothing does not trip over it.
    assert sandlot("create", env={"SANDLOT_GIT_AUTH": "Bearer x"}).returncode == 0
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"git": {"url": "https://example.invalid/r.git"}}))
    # The fake backend has no git: the create fails, and the kept record shows what was asked.
    assert sandlot("create", "--spec", str(spec), "--git-revision", "dev").returncode == 1
    listed = sandlot("list", "--status", "failed", "--json")
    (failed,) = json.loads(listed.stdout)
    assert failed["spec"]["git"]["url"] == "https://example.invalid/r.git"
    assert failed["spec"]["git"]["revision"] == "dev"


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("SANDLOT_NETWORK_POOL", "bogus", "SANDLOT_NETWORK_POOL must be an IPv4 network"),
        ("SANDLOT_NETWORK_POOL", "10.9.0.1/16", "SANDLOT_NETWORK_POOL must be an IPv4 network"),
        ("SANDLOT_NETWORK_NAMESERVER", "bogus", "SANDLOT_NETWORK_NAMESERVER must be IP or IP:PORT"),
    ],
)
def test_a_bad_network_setting_is_one_line(name: str, value: str, says: str) -> None:
    if os.geteuid() != 0 or shutil.which("crun") is None:
        pytest.skip("needs root and crun (the local backend reads these settings)")
    proc = sandlot("create", "--network", "deny-all", env={"SANDLOT_BACKEND": "local", name: value})
    assert says in one_line(proc)


def test_a_server_url_that_is_not_one_is_one_line() -> None:
    proc = sandlot("list", env={"SANDLOT_URL": "garbage", "SANDLOT_API_KEY": "k"})
    assert one_line(proc) == (
        "error: the server URL must start with http:// or https://, got 'garbage'"
    )
