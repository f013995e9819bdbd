"""Rootless local sandboxes, run by a real unprivileged user.

Root (this test process) makes the user ``sandlot-test`` when it is missing (``useradd -m``
gives it a subordinate id range, so its sandboxes have 65,536 ids) and, for the single-id case,
``sandlot-test-1id`` without one. Each test then starts this very file as a *driver* process
under that user (``setpriv --reuid --regid --init-groups``, its own ``HOME``, ``SANDLOT_HOME``
and ``XDG_RUNTIME_DIR``), which runs a :class:`LocalBackend` and answers JSON commands on its
stdin, while the test looks at the host from outside: process owners, file owners, what is left.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import pwd
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.needs_root, pytest.mark.slow]

USER = "sandlot-test"
SINGLE_USER = "sandlot-test-1id"
HERE = Path(__file__).resolve()


# ----------------------------------------------------------------------------- the driver
# Runs as the unprivileged user: ``python test_rootless.py --driver``. One JSON command per
# line on stdin, one JSON answer per line on stdout.


def _driver() -> None:  # pragma: no cover - runs in the user's process
    import anyio
    import anyio.to_thread

    from sandlot.backends.base import SnapshotRef
    from sandlot.backends.local import LocalBackend
    from sandlot.config import backend_dir, home
    from sandlot.models import SandboxSpec

    async def main() -> None:
        pool = os.environ.get("SANDLOT_TEST_POOL")
        backend = LocalBackend(
            backend_dir(home(), "local"), pool={"namespaces": int(pool)} if pool else None
        )
        out = sys.stdout

        def reply(doc: object) -> None:
            out.write(json.dumps(doc) + "\n")
            out.flush()

        async def sh(ref: str, script: str, stdin: bytes | None = None) -> dict[str, object]:
            ch = await backend.channel(ref)
            try:
                r = await ch.exec(["sh", "-c", script], timeout=60, stdin=stdin)
            finally:
                await ch.close()
            return {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}

        async def channel_suite(ref: str) -> dict[str, object]:
            ch = await backend.channel(ref)
            try:
                blob = secrets.token_bytes(3 << 20)
                await ch.write_file("/workspace/blob.bin", blob)
                back = b"".join([chunk async for chunk in ch.read_file("/workspace/blob.bin")])
                names = [f.name for f in await ch.list_files("/workspace")]
                info = await ch.stat("/workspace/blob.bin")
                echoed = await ch.exec(["cat"], stdin=b"through stdin", timeout=30)
                proc = await ch.start_process(["sh", "-c", "echo started; sleep 600"])
                listed = [p.id for p in await ch.list_processes()]
                await ch.signal_process(proc.id, signal.SIGTERM)
                ended = await ch.wait_process(proc.id, timeout=30)
                pty = await ch.open_pty(["sh"], rows=30, cols=100)
                await pty.write(b"stty size; echo pty-$((6*7)); exit\n")
                seen = b""
                with anyio.fail_after(30):
                    while b"pty-42" not in seen or b"30 100" not in seen:
                        chunk = await pty.read()
                        if not chunk:
                            break
                        seen += chunk
                rc = await pty.wait()
                timed = await ch.exec(["sh", "-c", "sleep 600 & sleep 600"], timeout=0.5)
                return {
                    "roundtrip": back == blob,
                    "names": names,
                    "size": info.size,
                    "stdin": echoed.stdout,
                    "listed": proc.id in listed,
                    "ended": not ended.running,
                    "pty": rc == 0,
                    "timed_out": timed.timed_out,
                }
            finally:
                await ch.close()

        async def sdk(op: str, spec: dict[str, object]) -> dict[str, object]:
            from sandlot.sdk import AsyncSandlot

            async with AsyncSandlot() as client:
                try:
                    box = await client.create(spec)
                except Exception as e:
                    return {
                        "error": type(e).__name__,
                        "message": str(e),
                        "records": len(await client.list(include_destroyed=True)),
                    }
                try:
                    r = await box.exec(["id", "-u"])
                    return {"stdout": r.stdout}
                finally:
                    await box.destroy()

        async def handle(cmd: dict[str, object]) -> object:
            op = cmd["op"]
            spec = SandboxSpec.model_validate(cmd.get("spec") or {"network": "deny-all"})
            ref = str(cmd.get("ref", ""))
            if op == "create":
                t = time.perf_counter()
                ref = await backend.create(str(cmd["id"]), spec)
                ch = await backend.channel(ref)
                await ch.exec(["true"])
                await ch.close()
                return {"ref": ref, "ms": (time.perf_counter() - t) * 1000}
            if op == "capabilities":
                caps = backend.capabilities()
                return {
                    "network": sorted(caps.network),
                    "limits": sorted(caps.limits),
                    "rootless": backend.rootless,
                    "full": backend.id_map.full if backend.id_map else None,
                    "unavailable": backend.unavailable(),
                }
            if op == "sh":
                return await sh(ref, str(cmd["script"]))
            if op == "sh_argv":
                ch = await backend.channel(ref)
                try:
                    r = await ch.exec([str(a) for a in cmd["argv"]], timeout=60)  # type: ignore[attr-defined]
                finally:
                    await ch.close()
                return {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}
            if op == "read":
                ch = await backend.channel(ref)
                try:
                    data = b"".join([c async for c in ch.read_file(str(cmd["path"]))])
                finally:
                    await ch.close()
                return data.decode()
            if op == "channel_suite":
                return await channel_suite(ref)
            if op == "host_processes":
                return backend.host_processes(ref)
            if op == "stop":
                await backend.stop(ref)
                return (await backend.inspect(ref)).state
            if op == "start":
                await backend.start(ref, spec)
                return (await backend.inspect(ref)).state
            if op == "destroy":
                await backend.destroy(ref)
                return True
            if op == "snapshot":
                snap = await backend.snapshot(ref, str(cmd["snapshot"]))
                return {"ref": snap.ref, "metadata": snap.metadata, "size": snap.size_bytes}
            if op == "fork":
                snap = SnapshotRef(str(cmd["snapshot"]), metadata=dict(cmd["metadata"]))  # type: ignore[arg-type]
                return await backend.fork(snap, list(cmd["ids"]), spec)  # type: ignore[arg-type]
            if op == "delete_snapshot":
                await backend.delete_snapshot(SnapshotRef(str(cmd["snapshot"])))
                return True
            if op == "reset":
                return await backend.reset(ref, None, spec)
            if op == "verify":
                return await backend.verify(ref)
            if op == "sdk":
                return await sdk(str(cmd["op"]), dict(cmd.get("spec") or {}))
            if op == "doctor":
                # The command line a user would type, in this driver's environment.
                cli = await anyio.run_process(
                    [sys.executable, "-m", "sandlot", "doctor", "--json"],
                    check=False,
                    stdin=subprocess.DEVNULL,
                )
                return {"rc": cli.returncode, "report": json.loads(cli.stdout)}
            if op == "cli":
                cli = await anyio.run_process(
                    [sys.executable, "-m", "sandlot", *[str(a) for a in cmd["args"]]],  # type: ignore[attr-defined]
                    check=False,
                    stdin=subprocess.DEVNULL,  # not the commands on ours
                )
                return {
                    "rc": cli.returncode,
                    "stdout": cli.stdout.decode(errors="replace"),
                    "stderr": cli.stderr.decode(errors="replace"),
                }
            if op == "fill_pool":
                await backend.fill_pool()
                return backend.pooled()
            if op == "drain_pool":
                await backend.drain_pool()
                return backend.pooled()
            if op == "read_host":
                return Path(str(cmd["path"])).read_text()
            if op == "paths":
                return {"state": str(backend.state_dir), "run": str(backend.run_dir)}
            if op == "cleanup":
                for owned in (await backend.list_owned()).values():
                    await backend.destroy(owned)
                await backend.aclose()
                return True
            msg = f"unknown op {op!r}"
            raise ValueError(msg)

        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                reply({"ok": True})
                return
            try:
                reply({"ok": True, "value": await handle(cmd)})
            except Exception as e:
                reply({"ok": False, "type": type(e).__name__, "message": str(e)})

    anyio.run(main)


if __name__ == "__main__" and sys.argv[1:] == ["--driver"]:
    _driver()
    sys.exit(0)


# ----------------------------------------------------------------------------- fixtures


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "root (to make the unprivileged test user)"
    for tool, pkg in (("crun", "crun"), ("setpriv", "util-linux"), ("useradd", "passwd")):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {pkg})"
    return None


def _ensure_user(name: str, *extra: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-m", *extra, name], check=True, capture_output=True)
        return pwd.getpwnam(name)


def _python_for(user: pwd.struct_passwd) -> tuple[str, str, Path] | None:
    """An interpreter the user can run that imports this checkout, the PYTHONPATH it needs
    and the driver (this file) to give it: the checkout and its venv as they are when the
    user can read them, else a copy the user can read (a checkout under /root, as on a fresh
    machine, is not)."""
    import anyio

    src = Path(__import__("sandlot").__file__).parent.parent
    site = Path(anyio.__file__).parent.parent
    python = _runnable(user, f"{src}:{site}", HERE)
    if python is not None:
        return python, f"{src}:{site}", HERE
    copy = _readable_copy(src)
    pythonpath = f"{copy / 'src'}:{copy / 'site'}"
    python = _runnable(user, pythonpath, copy / HERE.name)
    return None if python is None else (python, pythonpath, copy / HERE.name)


def _runnable(user: pwd.struct_passwd, pythonpath: str, driver: Path) -> str | None:
    """The first interpreter of this Python version that the user can run, that imports
    sandlot and its dependencies (pytest too: the driver is a test module) from
    ``pythonpath``, and that can read the ``driver`` file."""
    want = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for cand in (sys.executable, f"/usr/bin/python{want}", "/usr/bin/python3"):
        probe = subprocess.run(
            [
                "setpriv",
                f"--reuid={user.pw_uid}",
                f"--regid={user.pw_gid}",
                "--init-groups",
                "env",
                f"PYTHONPATH={pythonpath}",
                cand,
                "-c",
                "import sys, anyio, pydantic, pytest, sandlot; open(sys.argv[1]).close(); "
                "print('%d.%d' % sys.version_info[:2])",
                str(driver),
            ],
            capture_output=True,
            text=True,
            check=False,
            cwd="/",
        )
        if probe.returncode == 0 and probe.stdout.strip() == want:
            return cand
    return None


READABLE_CACHE = Path("/var/cache/sandlot-tests/python")
"""Where copies of the checkout and its runtime dependencies go that any user can read."""


def _runtime_distributions() -> list[importlib.metadata.Distribution]:
    """sandlot's runtime dependencies and pytest (the driver imports it), and theirs (no
    extras, markers for this Python)."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [*(importlib.metadata.requires("sandlot") or []), "pytest"]
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = req.name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency's own option, not installed
        seen[key] = dist
        todo.extend(dist.requires or [])
    return sorted(seen.values(), key=lambda d: d.metadata["Name"].lower())


def _readable_copy(src: Path) -> Path:
    """A copy of ``src/sandlot``, of the driver (this file) and of the installed runtime
    dependencies under :data:`READABLE_CACHE`, world-readable, keyed by what went into it
    (this Python's version, each distribution's name and version, the files' contents): made
    once per change, so repeated runs copy nothing, and a changed checkout never runs
    stale."""
    dists = _runtime_distributions()
    package = sorted(
        p for p in (src / "sandlot").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    digest = hashlib.sha256(f"{sys.version_info[:2]}".encode() + HERE.read_bytes())
    for d in dists:
        digest.update(f"{d.metadata['Name']}=={d.version}\n".encode())
    for p in package:
        digest.update(str(p.relative_to(src)).encode() + b"\0" + p.read_bytes())
    target = READABLE_CACHE / digest.hexdigest()[:16]
    if (target / ".complete").exists():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=_readable_dir(READABLE_CACHE)))
    try:
        _copy_readable(HERE, staging / HERE.name)
        for p in package:
            _copy_readable(p, staging / "src" / p.relative_to(src))
        for d in dists:
            for f in d.files or []:
                located = Path(str(d.locate_file(f)))
                if ".." in f.parts or "__pycache__" in f.parts or not located.is_file():
                    continue  # scripts outside site-packages; bytecode is made again
                _copy_readable(located, staging / "site" / f)
        (staging / ".complete").touch(mode=0o644)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            shutil.rmtree(staging)  # another run made the same copy meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _readable_dir(path: Path) -> Path:
    for p in [*reversed(path.parents), path]:
        if not p.exists():
            p.mkdir(mode=0o755)
    return path


def _copy_readable(source: Path, dest: Path) -> None:
    _readable_dir(dest.parent)
    shutil.copyfile(source, dest)
    dest.chmod(0o755 if os.access(source, os.X_OK) else 0o644)


class User:
    """The unprivileged user and a private directory tree of its own for one test module."""

    def __init__(self, name: str, *useradd: str) -> None:
        self.pw = _ensure_user(name, *useradd)
        self.uid, self.gid = self.pw.pw_uid, self.pw.pw_gid
        python = _python_for(self.pw)
        if python is None:
            pytest.skip(
                f"needs a Python {sys.version_info[0]}.{sys.version_info[1]} {name} can run"
            )
        self.python, self.pythonpath, self.driver = python
        self.base = Path(self.pw.pw_dir) / f".sandlot-tests-{secrets.token_hex(3)}"
        self.cache = self.mkdir(self.base / "cache")

    def mkdir(self, path: Path) -> Path:
        for p in [
            *reversed(path.relative_to(self.pw.pw_dir).parents),
            path.relative_to(self.pw.pw_dir),
        ]:
            full = Path(self.pw.pw_dir) / p
            if not full.exists():
                full.mkdir(mode=0o700)
                os.chown(full, self.uid, self.gid)
        return path

    def subids(self) -> tuple[int, int] | None:
        for line in Path("/etc/subuid").read_text().splitlines():
            parts = line.split(":")
            if len(parts) == 3 and parts[0] in (self.pw.pw_name, str(self.uid)):
                return int(parts[1]), int(parts[2])
        return None

    def processes(self) -> set[int]:
        """Every process on the host whose real uid is this user's or one of its subids."""
        lo, n = self.subids() or (self.uid, 1)
        found = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    uid = _ruid(int(entry.name))
                    if uid == self.uid or lo <= uid < lo + n:
                        found.add(int(entry.name))
        return found

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def _ruid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    msg = f"no Uid line for {pid}"
    raise LookupError(msg)


class Driver:
    """The user's driver process: ``driver("create", id=..., spec=...)`` returns its answer."""

    def __init__(
        self,
        user: User,
        name: str,
        *,
        wrap: list[str] | None = None,
        inner: list[str] | None = None,
        path: str = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        pool: int = 0,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """``wrap`` runs (as root) before dropping to the user, ``inner`` after it."""
        self.user = user
        self.dir = user.mkdir(user.base / name)
        self.home = user.mkdir(self.dir / "home")
        self.run = user.mkdir(self.dir / "run")
        env = {
            "HOME": user.pw.pw_dir,
            "PATH": path,
            "PYTHONPATH": user.pythonpath,
            "SANDLOT_HOME": str(self.home),
            "SANDLOT_CACHE": str(user.cache),
            "XDG_RUNTIME_DIR": str(self.run),
            "LANG": "C.UTF-8",
        }
        if pool:
            env["SANDLOT_TEST_POOL"] = str(pool)
        env.update(extra_env or {})
        self._log = open(self.dir / "driver.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                *(wrap or []),
                "setpriv",
                f"--reuid={user.uid}",
                f"--regid={user.gid}",
                "--init-groups",
                *(inner or []),
                user.python,
                str(user.driver),
                "--driver",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd="/",
        )

    def raw(self, op: str, **args: object) -> dict[str, object]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            log = (self.dir / "driver.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"the driver died during {op}: {log}")
        return dict(json.loads(line))

    def __call__(self, op: str, **args: object) -> object:
        doc = self.raw(op, **args)
        assert doc["ok"], f"{op} failed: {doc.get('type')}: {doc.get('message')}"
        return doc.get("value")

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.raw("cleanup")
                self.raw("quit")
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout, self._log):
                if stream is not None:
                    stream.close()


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    reason = _missing()
    if reason:
        pytest.skip(f"needs {reason}")
    u = User(USER)
    yield u
    u.remove()


@pytest.fixture
def driver(user: User, request: pytest.FixtureRequest) -> Iterator[Driver]:
    d = Driver(user, request.node.name.replace("[", "-").replace("]", ""))
    yield d
    d.close()


def _spec(**fields: object) -> dict[str, object]:
    return {"network": "deny-all", **fields}


def _new_id() -> str:
    return f"rl-{secrets.token_hex(4)}"


# ----------------------------------------------------------------------------- tests


def test_root_inside_is_the_caller_outside(user: User, driver: Driver) -> None:
    caps = driver("capabilities")
    assert caps["rootless"] is True
    assert caps["unavailable"] is None
    ref = driver("create", id=_new_id(), spec=_spec())["ref"]
    out = driver("sh", ref=ref, script="id -u; id -g; cat /proc/self/uid_map")
    lines = out["stdout"].splitlines()
    assert lines[:2] == ["0", "0"]
    subids = user.subids()
    assert subids is not None
    assert caps["full"] is True
    # The sandbox's own user namespace: ids 0..65535 of the helper's, one to one.
    assert [line.split() for line in lines[2:]] == [["0", "0", "1"], ["1", "1", "65535"]]

    # A process as root and one as uid 1000 inside: on the host, the caller and a subid.
    driver(
        "sh",
        ref=ref,
        script=(
            "echo root > /workspace/by-root; "
            "setpriv --reuid=1000 --regid=1000 --clear-groups "
            "sh -c 'echo x > /tmp/by-1000; exec sleep 600' >/dev/null 2>&1 &"
        ),
    )
    pids = driver("host_processes", ref=ref)
    upper = Path(driver("paths")["state"]) / ref / "layer" / "upper"
    deadline = time.monotonic() + 10
    owners: set[int] = set()
    while time.monotonic() < deadline:
        pids = driver("host_processes", ref=ref)
        owners = {_ruid(p) for p in pids if Path(f"/proc/{p}").exists()}
        if subids[0] + 999 in owners and (upper / "tmp" / "by-1000").exists():
            break
        time.sleep(0.05)
    assert 0 not in owners
    assert owners == {user.uid, subids[0] + 999}, (owners, pids)

    st = (upper / "workspace" / "by-root").stat()
    assert (st.st_uid, st.st_gid) == (user.uid, user.gid)
    st = (upper / "tmp" / "by-1000").stat()
    assert st.st_uid == subids[0] + 999


def test_a_host_secret_stays_unreadable(driver: Driver) -> None:
    # Under /usr, which rootless sandboxes see (read-only, owned by nobody): visible, not
    # readable, because root inside holds no capability over the host's root-owned files.
    secret = Path("/usr/local/share") / f"sandlot-secret-{secrets.token_hex(4)}"
    token = secrets.token_hex(16)
    secret.write_text(token)
    secret.chmod(0o600)
    try:
        ref = driver("create", id=_new_id(), spec=_spec())["ref"]
        out = driver(
            "sh",
            ref=ref,
            script=f"ls -ln {secret}; cat {secret}; cp {secret} /tmp/x; chmod 644 {secret}; "
            f"echo overwritten > {secret}; cat /proc/1/root{secret}",
        )
        assert secret.name in out["stdout"]  # it is there: the test can tell
        assert token not in out["stdout"] + out["stderr"]
        assert f"cat: {secret}: Permission denied" in out["stderr"], out
        assert secret.read_text() == token
        assert secret.stat().st_mode & 0o777 == 0o600
    finally:
        secret.unlink()


def test_hardening_matches_rootful(driver: Driver) -> None:
    ref = driver("create", id=_new_id(), spec=_spec())["ref"]
    out = driver(
        "sh",
        ref=ref,
        script=(
            "grep -E '^(NoNewPrivs|Seccomp|CapEff|CapBnd):' /proc/self/status; "
            "grep '^Max processes' /proc/self/limits; "
            "unshare --user true && echo UNSHARED; "
            "mount -t tmpfs x /mnt && echo MOUNTED; "
            "echo 1 > /proc/sys/kernel/sysrq && echo SYSCTL; "
            "head -c 10 /proc/kcore | wc -c; "
            "hostname other && echo RENAMED"
        ),
    )
    status = dict(line.split(":\t", 1) for line in out["stdout"].splitlines() if ":\t" in line)
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"
    assert int(status["CapEff"], 16) & (1 << 21) == 0  # no CAP_SYS_ADMIN
    assert int(status["CapBnd"], 16) & (1 << 12) == 0  # no CAP_NET_ADMIN
    # No pids cgroup rootless: a process limit per uid bounds a fork bomb instead (enforced,
    # as root inside is the caller, not the host's root, which the kernel would exempt).
    nproc = next(line for line in out["stdout"].splitlines() if line.startswith("Max processes"))
    want = min(4096, resource.getrlimit(resource.RLIMIT_NPROC)[1])
    assert nproc.split()[2:4] == [str(want), str(want)], nproc
    for escaped in ("UNSHARED", "MOUNTED", "SYSCTL", "RENAMED"):
        assert escaped not in out["stdout"]
    assert out["stdout"].splitlines()[-1].strip() == "0"  # /proc/kcore is masked


def test_exec_files_processes_and_terminals(driver: Driver) -> None:
    ref = driver("create", id=_new_id(), spec=_spec(workdir="/work/space"))["ref"]
    got = driver("channel_suite", ref=ref)
    assert got == {
        "roundtrip": True,
        "names": ["blob.bin"],
        "size": 3 << 20,
        "stdin": "through stdin",
        "listed": True,
        "ended": True,
        "pty": True,
        "timed_out": True,
    }
    assert driver("sh", ref=ref, script="pwd")["stdout"] == "/work/space\n"


def test_stop_and_resume_keep_files(user: User, driver: Driver) -> None:
    ref = driver("create", id=_new_id(), spec=_spec())["ref"]
    driver("sh", ref=ref, script="echo kept > /workspace/f; echo etc > /etc/marker")
    assert driver("stop", ref=ref) == "stopped"
    assert driver("host_processes", ref=ref) == []
    assert driver("start", ref=ref) == "running"
    out = driver("sh", ref=ref, script="cat /workspace/f /etc/marker")
    assert out["stdout"] == "kept\netc\n"


def test_hybrid_host_with_controllers_on_v2(user: User) -> None:
    """A freshly booted hybrid host keeps the controllers it did not give to v1 (hugetlb here,
    until root mounts its v1 hierarchy) on the v2 one, and crun then refuses every container
    ("cgroups in hybrid mode not supported"), its cgroup manager disabled or not; a normal
    user cannot mount hugetlb. Reproduced in a mount namespace of the test's own, where v2
    lists a controller: the rootless sandbox still runs, stops, resumes and goes."""
    unified = Path("/sys/fs/cgroup/unified/cgroup.controllers")
    if not unified.exists() or Path("/sys/fs/cgroup/cgroup.controllers").exists():
        pytest.skip("needs a cgroup v1/v2 hybrid host")
    fake = user.base / "v2-controllers"
    fake.write_text("hugetlb\n")
    fake.chmod(0o444)
    wrap = [
        "unshare",
        "--mount",
        "--propagation=private",
        "sh",
        "-c",
        f'mount --bind "$0" {unified} && exec "$@"',
        str(fake),
    ]
    d = Driver(user, "hybrid", wrap=wrap)
    try:
        ref = d("create", id=_new_id(), spec=_spec())["ref"]
        assert d("sh", ref=ref, script="id -u")["stdout"] == "0\n"
        assert d("stop", ref=ref) == "stopped"
        assert d("start", ref=ref) == "running"
        d("destroy", ref=ref)
        # The driver did see the controller: this is the host crun refuses outright.
        assert d("read_host", path=str(unified)) == "hugetlb\n"
    finally:
        d.close()


def test_warm_pool_claims_a_booted_sandbox(user: User) -> None:
    d = Driver(user, "pool", pool=2)
    try:
        pooled = d("fill_pool")
        assert len(pooled) == 2
        state = Path(d("paths")["state"])
        ref = d("create", id=_new_id(), spec=_spec())["ref"]
        meta = json.loads((state / ref / "meta.json").read_text())
        assert meta["container"] in pooled  # claimed, not booted cold
        out = d("sh", ref=ref, script="id -u; echo x > /workspace/f; stat -c %u /workspace/f")
        assert out["stdout"] == "0\n0\n", out
        assert (state / ref / "layer" / "upper" / "workspace" / "f").stat().st_uid == user.uid
        # A spec the pool cannot serve rootless (another working directory) boots cold.
        other = d("create", id=_new_id(), spec=_spec(workdir="/src"))["ref"]
        meta = json.loads((state / other / "meta.json").read_text())
        assert meta["container"] not in pooled
        assert d("sh", ref=other, script="pwd")["stdout"] == "/src\n"
        for r in (ref, other):
            d("destroy", ref=r)
        assert d("drain_pool") == []
        assert not list((state / ".pool" / "namespaces").iterdir())
    finally:
        d.close()


def _footprint(user: User, driver: Driver) -> dict[str, set[str]]:
    paths = driver("paths")
    files: set[str] = set()
    for top in (Path(paths["state"]), Path(paths["run"]).parent, driver.run):
        for dirpath, dirnames, filenames in os.walk(top):
            files.update(f"{dirpath}/{n}" for n in dirnames + filenames)
    mounts = {
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if str(user.base) in line or str(driver.run) in line
    }
    procs = {
        f"{p} {_cmdline(p)}"
        for p in user.processes() - {driver.proc.pid} - _descendants(driver.proc.pid)
    }
    return {"files": files, "mounts": mounts, "processes": procs}


def _cmdline(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # A zombie has no command line left; its name and state say what it was.
    fields = stat[stat.rindex(")") + 2 :].split()
    return f"{cmdline.strip()} [{stat[stat.index('(') + 1 : stat.rindex(')')]} {fields[0]} ppid {fields[1]}]"


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                    out.add(int(entry.name))
    return out


def test_destroy_leaves_nothing(user: User, driver: Driver) -> None:
    # The first sandbox builds what the backend keeps (the root skeleton, the compiled agent).
    warm = driver("create", id=_new_id(), spec=_spec())["ref"]
    driver("destroy", ref=warm)
    before = _footprint(user, driver)
    refs = [driver("create", id=_new_id(), spec=_spec())["ref"] for _ in range(2)]
    for ref in refs:
        driver(
            "sh",
            ref=ref,
            script=(
                "mkdir -p /workspace/d/e && echo x > /workspace/d/e/f && chmod 000 /workspace/d; "
                "setpriv --reuid=1000 --regid=1000 --clear-groups sleep 600 >/dev/null 2>&1 &"
            ),
        )
    during = _footprint(user, driver)
    assert during["files"] - before["files"]
    assert during["processes"] - before["processes"]
    assert during["mounts"] == before["mounts"] == set()  # nothing is mounted on the host
    driver("stop", ref=refs[1])
    for ref in refs:
        driver("destroy", ref=ref)
    after = _footprint(user, driver)
    assert after == before, (before["processes"], after["processes"])


def test_limits_are_refused_before_anything_is_made(user: User, driver: Driver) -> None:
    caps = driver("capabilities")
    assert caps["limits"] == []
    paths = driver("paths")
    for resources in ({"memory_mb": 128}, {"pids": 64}, {"vcpus": 1}, {"disk_mb": 16}):
        sid = _new_id()
        doc = driver.raw("create", id=sid, spec=_spec(resources=resources))
        assert (doc["ok"], doc["type"]) == (False, "NotSupported"), doc
        assert not (Path(paths["state"]) / sid).exists()
    doc = driver.raw(
        "create",
        id=_new_id(),
        spec=_spec(backend_options={"local": {"isolation": "gvisor"}}),
    )
    assert (doc["ok"], doc["type"]) == (False, "NotSupported"), doc
    # Through the SDK, the Manager refuses it from the capabilities, before any record.
    got = driver("sdk", spec=_spec(resources={"memory_mb": 128}))
    assert (got["error"], got["records"]) == ("NotSupported", 0), got
    assert "memory_mb" in got["message"]
    assert not list(Path(paths["state"]).glob("*/meta.json"))
    # And the whole stack works rootless: the default home, the Manager, the local backend.
    assert driver("sdk", spec=_spec())["stdout"] == "0\n"
    # `sandlot doctor` says so: usable, rootless, and limits refused (an optional feature).
    got = driver("doctor")
    report = got["report"]
    checks = {c["name"]: c for c in report["checks"]["local"]}
    assert report["backends"]["local"]["usable"] is True, checks
    assert checks["local: rootless mode"]["ok"] is True
    limits = checks["local: resource limits (memory_mb, pids, vcpus, disk_mb)"]
    assert (limits["ok"], limits["required"]) == (False, False)
    assert limits["detail"].startswith("refused: no delegated cgroup")
    if Path("/sys/fs/cgroup/unified").is_dir() and Path("/sys/fs/cgroup/memory").is_dir():
        assert "hybrid" in limits["detail"]
    assert checks["local: subordinate ids (65,536 ids per sandbox)"]["ok"] is True
    # The command line refuses a limit with the reason, and runs without one.
    cli = driver("cli", args=["run", "--network", "deny-all", "--memory", "128", "--", "true"])
    assert cli["rc"] != 0
    assert "Traceback" not in cli["stderr"]
    assert "memory_mb" in cli["stderr"], cli
    assert "run sandlot as root" in cli["stderr"], cli  # the refusal says what to change
    cli = driver("cli", args=["run", "--network", "deny-all", "--", "id", "-u"])
    assert (cli["rc"], cli["stdout"]) == (0, "0\n"), cli


def test_deny_all_has_only_loopback(driver: Driver) -> None:
    ref = driver("create", id=_new_id(), spec=_spec())["ref"]
    out = driver(
        "sh", ref=ref, script="tail -n +3 /proc/net/dev | cut -d: -f1; cat /proc/net/route"
    )
    lines = [line.strip() for line in out["stdout"].splitlines()]
    assert lines[0] == "lo"
    assert len(lines) == 2  # lo, and the route table's header only
    doc = driver.raw("create", id=_new_id(), spec={"network": {"allow_domains": ["example.com"]}})
    assert (doc["ok"], doc["type"]) == (False, "NotSupported")


def test_single_id_without_subordinate_ids() -> None:
    reason = _missing()
    if reason:
        pytest.skip(f"needs {reason}")
    # SUB_UID_COUNT=0: useradd gives this user no /etc/subuid range.
    u = User(SINGLE_USER, "-K", "SUB_UID_COUNT=0", "-K", "SUB_GID_COUNT=0")
    if u.subids() is not None:
        pytest.skip(f"{SINGLE_USER} has a subordinate id range")
    d = Driver(u, "single")
    try:
        assert driver_caps_full(d) is False
        ref = d("create", id=_new_id(), spec=_spec())["ref"]
        out = d(
            "sh",
            ref=ref,
            script="id -u; cat /proc/self/uid_map; echo x > /workspace/f; chown 1000 /workspace/f",
        )
        assert out["stdout"].split()[:4] == ["0", "0", "0", "1"]
        assert out["stderr"]  # there is no uid 1000 to give a file to
        upper = Path(d("paths")["state"]) / ref / "layer" / "upper"
        assert (upper / "workspace" / "f").stat().st_uid == u.uid
    finally:
        d.close()
        u.remove()


def test_without_uidmap_a_sandbox_has_one_id(user: User) -> None:
    """No ``newuidmap``/``newgidmap`` (Debian package uidmap) on the PATH: sandboxes still run,
    with the caller as their only id, and doctor names the package."""
    bindir = user.mkdir(user.base / "bin-without-uidmap")
    for entry in Path("/usr/bin").iterdir():
        if entry.name not in ("newuidmap", "newgidmap"):
            (bindir / entry.name).symlink_to(entry)
    # /bin is /usr/bin on a merged-/usr host: left off the PATH.
    d = Driver(user, "no-uidmap", path=f"{bindir}:/usr/local/bin:/usr/sbin:/sbin")
    try:
        assert driver_caps_full(d) is False
        ref = d("create", id=_new_id(), spec=_spec())["ref"]
        out = d("sh", ref=ref, script="id -u; cat /proc/self/uid_map")
        assert out["stdout"].split() == ["0", "0", "0", "1"], out
        checks = {c["name"]: c for c in d("doctor")["report"]["checks"]["local"]}
        subids = checks["local: subordinate ids (65,536 ids per sandbox)"]
        assert subids["ok"] is False
        assert "newuidmap and newgidmap missing (Debian package uidmap)" in subids["detail"]
        assert subids["fix"] == "apt-get install uidmap"
        d("destroy", ref=ref)
    finally:
        d.close()


# Run as the user before the driver: a user namespace of its own in which no further user
# namespace may be made (user.max_user_namespaces is per namespace), as on a host that has
# them disabled; changing the host's sysctl would break every other test on the machine.
_NO_USERNS = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000) != 0:
    sys.exit("unshare: " + os.strerror(ctypes.get_errno()))
for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
with open("/proc/sys/user/max_user_namespaces", "w") as f:
    f.write("0")
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_without_user_namespaces_create_says_why(user: User) -> None:
    d = Driver(user, "no-userns", inner=[user.python, "-c", _NO_USERNS])
    try:
        caps = d("capabilities")
        assert "user namespaces" in str(caps["unavailable"]), caps
        doc = d.raw("create", id=_new_id(), spec=_spec())
        assert (doc["ok"], doc["type"]) == (False, "BackendUnavailable"), doc
        assert "sysctl -w user.max_user_namespaces=65536" in str(doc["message"])
        assert not list(Path(d("paths")["state"]).glob("*/meta.json"))
        # The command line: the reason, not a traceback.
        cli = d("cli", args=["run", "--network", "deny-all", "--", "true"])
        assert cli["rc"] != 0
        assert "Traceback" not in cli["stderr"]
        assert "user namespaces" in cli["stderr"], cli
        report = d("doctor")["report"]
        checks = {c["name"]: c for c in report["checks"]["local"]}
        assert report["backends"]["local"]["usable"] is False
        userns = checks["local: user namespaces"]
        assert (userns["ok"], userns["detail"]) == (False, "max_user_namespaces=0")
    finally:
        d.close()


def test_image_tarball_keeps_its_owners(user: User, driver: Driver) -> None:
    src = user.mkdir(driver.dir / "image-src")
    for sub in ("bin", "etc", "dev", "home/u"):
        (src / sub).mkdir(parents=True)
    (src / "etc" / "marker").write_text("from the image\n")
    os.chown(src / "home" / "u", 1000, 1000)
    os.mknod(src / "dev" / "null", 0o666 | 0o020000, os.makedev(1, 3))
    tarball = driver.dir / "image.tar"
    subprocess.run(["tar", "-C", str(src), "-cf", str(tarball), "."], check=True)
    tarball.chmod(0o644)
    ref = driver("create", id=_new_id(), spec=_spec(image=str(tarball)))["ref"]
    # Nothing to run in this image: the host's stat, with the host's loader and libraries (as
    # the agent runs the host's Python there).
    loader = Path("/usr/lib64/ld-linux-x86-64.so.2").resolve()
    if not loader.is_relative_to("/usr"):
        pytest.skip("needs an x86-64 host with a merged /usr")
    inside = f"/.sandlot{loader}"
    libdir = f"/.sandlot{loader.parent}"
    argv = [inside, "--library-path", libdir, "/.sandlot/usr/bin/stat", "-c", "%u %n", "/home/u"]
    out = driver("sh_argv", ref=ref, argv=argv)
    assert out["stdout"] == "1000 /home/u\n", out
    data = driver("read", ref=ref, path="/etc/marker")
    assert data == "from the image\n"


def driver_caps_full(d: Driver) -> object:
    return d("capabilities")["full"]


@pytest.mark.timeout(300)
def test_snapshot_fork_reset(user: User, driver: Driver) -> None:
    ref = driver("create", id=_new_id(), spec=_spec())["ref"]
    driver(
        "sh",
        ref=ref,
        script=(
            "echo secret > /root/private && chmod 600 /root/private; "
            "mkdir -p /home/user/d && echo mine > /home/user/d/f && chown -R 1000:1000 /home/user/d "
            "&& chmod 700 /home/user/d; rm -rf /var/log; sleep 600 &"
        ),
    )
    snap = driver("snapshot", ref=ref, snapshot="rl-snap")
    assert snap["size"] > 0
    # The sandbox ran on after the snapshot (its processes were stopped, then continued).
    assert driver("sh", ref=ref, script="echo alive")["stdout"] == "alive\n"
    kids = driver(
        "fork", snapshot=snap["ref"], metadata=snap["metadata"], ids=[_new_id(), _new_id()]
    )
    for kid in kids:
        out = driver(
            "sh",
            ref=kid,
            script="cat /root/private; stat -c '%u %a' /home/user/d /home/user/d/f; ls /var/log",
        )
        assert out["stdout"].splitlines() == ["secret", "1000 700", "1000 644"]
        assert "No such file" in out["stderr"]
    driver("sh", ref=kids[0], script="echo changed > /workspace/new")
    report = driver("reset", ref=kids[0])
    assert report["ok"], report
    out = driver("sh", ref=kids[0], script="ls /workspace; cat /root/private")
    assert out["stdout"] == "secret\n"
    assert driver("verify", ref=kids[0])["ok"]
    # Deleting the snapshot removes its layer (files of the user's subids) once unused.
    driver("delete_snapshot", snapshot=snap["ref"])
    for kid in [ref, *kids]:
        driver("destroy", ref=kid)
    snapshots = Path(driver("paths")["state"]) / ".snapshots"
    assert list(snapshots.iterdir()) == []


@pytest.fixture
def tun_for_users() -> Iterator[None]:
    """slirp4netns opens /dev/net/tun with the user's rights; Debian's udev makes it 0666,
    hosts without udev may leave it 0600. Opened up for the test, as Debian has it."""
    tun = Path("/dev/net/tun")
    if not tun.exists():
        pytest.skip("needs /dev/net/tun (CONFIG_TUN)")
    if shutil.which("slirp4netns") is None:
        pytest.skip("needs slirp4netns (Debian package slirp4netns)")
    mode = tun.stat().st_mode & 0o777
    if mode & 0o006 != 0o006:
        tun.chmod(0o666)
    try:
        yield
    finally:
        tun.chmod(mode)


class _Server:
    """A one-line TCP server: answers ``token`` to every connection."""

    def __init__(self, sock: socket.socket, token: bytes) -> None:
        self.sock = sock
        self.token = token
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.sendall(self.token)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def netns_server() -> Iterator[tuple[str, int, bytes]]:
    """A server in a network namespace of its own, routed from the host over a veth pair:
    reachable the way any outside server is, and not on the host's loopback."""
    if shutil.which("ip") is None:
        pytest.skip("needs ip (Debian package iproute2)")
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"slrt-{tag}", f"slrh{tag}", f"slrn{tag}"
    net = f"198.18.{secrets.randbelow(200) + 20}"
    setup = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{net}.1/30", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "-n", ns, "addr", "add", f"{net}.2/30", "dev", ns_if],
        ["ip", "-n", ns, "link", "set", ns_if, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
    ]
    token = secrets.token_hex(8).encode()
    server = None
    try:
        for argv in setup:
            subprocess.run(argv, check=True, capture_output=True)
        # The listening socket is made inside the namespace and served from here.
        fd_r, fd_w = socket.socketpair()
        child = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                "import socket, sys; s = socket.socket(); "
                f"s.bind(('{net}.2', 8080)); s.listen(16); "
                "socket.send_fds(socket.socket(fileno=int(sys.argv[1])), [b'x'], [s.fileno()])",
                str(fd_w.fileno()),
            ],
            pass_fds=[fd_w.fileno()],
            check=True,
            capture_output=True,
        )
        assert child.returncode == 0
        _, fds, _, _ = socket.recv_fds(fd_r, 1, 1)
        fd_r.close()
        fd_w.close()
        server = _Server(socket.socket(fileno=fds[0]), token)
        yield f"{net}.2", 8080, token
    finally:
        if server is not None:
            server.close()
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], check=False, capture_output=True)


@pytest.mark.usefixtures("tun_for_users")
def test_allow_all_reaches_out_but_not_the_host_loopback(
    user: User, driver: Driver, netns_server: tuple[str, int, bytes]
) -> None:
    assert "allow-all" in driver("capabilities")["network"]
    address, port, token = netns_server
    loop = socket.socket()
    loop.bind(("127.0.0.1", 0))
    loop.listen(16)
    loop_token = secrets.token_hex(8).encode()
    local = _Server(loop, loop_token)
    # A service on all of the host's addresses: reachable from outside, not from a sandbox.
    host_ip = _host_address()
    exposed = socket.socket()
    exposed.bind(("0.0.0.0", 0))
    exposed.listen(16)
    public = _Server(exposed, loop_token)
    try:
        ref = driver("create", id=_new_id(), spec=_spec(network="allow-all"))["ref"]
        probe = (
            "import socket, sys\n"
            "for host, port in [(sys.argv[1], int(sys.argv[2])), ('10.0.2.2', int(sys.argv[3])),"
            " ('127.0.0.1', int(sys.argv[3])), (sys.argv[4], int(sys.argv[5])),"
            " ('169.254.169.254', 80)]:\n"
            "    try:\n"
            "        print(socket.create_connection((host, port), timeout=5).recv(100).decode())\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n"
        )
        out = driver(
            "sh",
            ref=ref,
            script=f"python3 -c \"$(cat <<'EOF'\n{probe}EOF\n)\" {address} {port} "
            f"{loop.getsockname()[1]} {host_ip} {exposed.getsockname()[1]}; "
            "tail -n +3 /proc/net/dev | cut -d: -f1",
        )
        lines = [line.strip() for line in out["stdout"].splitlines()]
        assert lines[0] == token.decode(), out
        assert lines[1].startswith("refused"), out  # the host's loopback, through the gateway
        assert lines[2].startswith("refused"), out  # the sandbox's own loopback
        assert lines[3].startswith("refused"), out  # the host's own address
        assert lines[4].startswith("refused"), out  # link-local (cloud metadata)
        assert loop_token.decode() not in out["stdout"]
        assert sorted(lines[5:]) == ["lo", "tap0"]
        slirps = [p for p in user.processes() if _comm(p) == "slirp4netns"]
        assert slirps
        driver("destroy", ref=ref)
        assert not [p for p in user.processes() if _comm(p) == "slirp4netns"]
        # The address pool of rootful sandboxes on this host is fenced off too: with the pool
        # set over the outside server, the same connection is refused.
        fenced = Driver(user, "fenced", extra_env={"SANDLOT_NETWORK_POOL": f"{address}/32"})
        try:
            ref = fenced("create", id=_new_id(), spec=_spec(network="allow-all"))["ref"]
            out = fenced(
                "sh",
                ref=ref,
                script=f"python3 -c \"import socket; socket.create_connection(('{address}', "
                f'{port}), timeout=5)" 2>&1 | tail -n 1',
            )
            assert "Error" in out["stdout"], out
            fenced("destroy", ref=ref)
        finally:
            fenced.close()
    finally:
        local.close()
        public.close()


def _host_address() -> str:
    """A non-loopback IPv4 address of this host (its default route's source)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent: this only picks a route
        except OSError:
            pytest.skip("needs a route off this host")
        addr = s.getsockname()[0]
    if addr.startswith("127."):
        pytest.skip("needs a host address other than loopback")
    return str(addr)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_create_to_first_exec_is_timed(driver: Driver) -> None:
    """Not a timed assertion (that is ``bench/``): the numbers go to the report."""
    driver("destroy", ref=driver("create", id=_new_id(), spec=_spec())["ref"])
    times = []
    for _ in range(10):
        got = driver("create", id=_new_id(), spec=_spec())
        times.append(got["ms"])
        driver("destroy", ref=got["ref"])
    times.sort()
    print(f"rootless create -> first exec: p50 {times[5]:.1f} ms, max {times[-1]:.1f} ms")
    assert all(t > 0 for t in times)
