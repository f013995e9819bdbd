"""The shipped default policy, on both engines, against a table of commands."""

from __future__ import annotations

from importlib.resources import files

import pytest

from sandlot.policy import Outcome, PolicyEngine, Principal, ReasonCode, load_engine

from .conftest import AGENT, SANDBOX, decide, exec_request, request

DENIED = [
    "rm -rf /",
    "rm -fr /*",
    "/bin/rm --recursive --force /",
    "rm -r -f //",
    "sh -c 'cd / && rm -rf .'",
    'bash -lc "rm -rf /"',
    "sudo rm -rf --no-preserve-root /",
    "rm --no-preserve-root -r /tmp/x",
    "rm -rf /usr",
    "rm -rf /etc/",
    "rm -Rf /home",
    "rm -rf /boot/../",
    "env FOO=1 nice -n 5 rm -rf /bin",
    "busybox rm -rf /lib",
    "echo ok && rm -rf /var",
    "rm -rf /{usr,etc}",
    "rm -rf /usr/*",
    "timeout 100 sudo -u root rm -rf /root",
    'rm -rf "/"',
    'bash -c "echo start; rm -rf /*"',
    "eval 'rm -rf /'",
    "echo $(rm -rf /)",
    'echo "$X" && rm -rf /sys',
    "find / -delete",
    "find /etc -name '*.conf' -delete",
    "chmod -R 000 /",
    "chown -R nobody:nogroup /usr",
    "chmod -R 777 /etc/*",
    "mv /etc /tmp/etc",
    "dd if=/dev/zero of=/dev/sda bs=1M",
    "dd if=image.iso of=/dev/nvme0n1",
    "cat image > /dev/sda",
    "echo x >> /dev/vda1",
    "mkfs.ext4 /dev/sda1",
    "mkfs -t ext4 /dev/sdb",
    "shred -n 3 /dev/sda",
    "wipefs -a /dev/sda",
    "sh -c 'dd if=/dev/urandom of=/dev/sda'",
    "tee /dev/sda < image",
    "cp disk.img /dev/sdc",
    "sudo bash -c 'cat /tmp/img > /dev/mmcblk0'",
]

ALLOWED = [
    "ls -la",
    "python3 -m pytest -q",
    "pip install requests",
    "apt-get install -y curl",
    "sudo apt-get update",
    "npm install",
    "git status",
    "rm -rf /tmp/build",
    "rm -rf ./node_modules",
    "rm -rf /workspace/dist",
    "rm -rf build/*",
    "rm -f /etc/motd",
    "rm -r /usr/local/lib/python3.11/site-packages/foo",
    "echo hi > /dev/null",
    "make 2>&1 | tee /tmp/log",
    "dd if=/dev/zero of=/tmp/disk.img bs=1M count=10",
    "mkfs.ext4 /tmp/disk.img",
    "cat /dev/urandom | head -c 10 > /tmp/r",
    "find . -name '*.pyc' -delete",
    "chmod -R u+w /workspace",
    "bash -lc 'cd /workspace && make test'",
    "echo $HOME",
    "for f in *.py; do python3 $f; done",
    "cat <<EOF > /tmp/x\nhello\nEOF",
    "dd if=/dev/sda of=/tmp/backup.img",
    "curl -sSL https://example.com -o /tmp/page",
    "mv /tmp/a /tmp/b",
    "ls /dev/sd*",
    "wipefs -n /dev/sda",
    "fdisk -l /dev/sda",
]


@pytest.fixture(params=["cedar", "builtin"], scope="module")
def engine(request: pytest.FixtureRequest) -> PolicyEngine:
    return load_engine({"engine": request.param})


def test_the_table_is_big_enough() -> None:
    assert len(DENIED) + len(ALLOWED) >= 40


@pytest.mark.parametrize("command", DENIED)
def test_denied(engine: PolicyEngine, command: str) -> None:
    d = decide(engine, exec_request(command))
    assert d.outcome is Outcome.DENY, d
    assert d.reason_code is ReasonCode.POLICY_VIOLATION
    assert d.matched
    assert all(m.startswith("deny-") for m in d.matched)
    # The same command as a background process, or through an exact argv, is denied too.
    assert decide(engine, request("process.start", command=command)).outcome is Outcome.DENY
    assert decide(engine, exec_request(["sh", "-c", command])).outcome is Outcome.DENY


@pytest.mark.parametrize("command", ALLOWED)
def test_allowed(engine: PolicyEngine, command: str) -> None:
    d = decide(engine, exec_request(command))
    assert d.outcome is Outcome.ALLOW, d
    assert d.reason_code is ReasonCode.OK
    assert d.matched == ("allow-run",)


@pytest.mark.parametrize(
    ("action", "args", "outcome", "code"),
    [
        ("fs.write", {"path": "/workspace/src/main.py"}, Outcome.ALLOW, ReasonCode.OK),
        ("fs.write", {"path": "/tmp/x"}, Outcome.ALLOW, ReasonCode.OK),
        ("fs.mkdir", {"path": "/root/.cache"}, Outcome.ALLOW, ReasonCode.OK),
        ("fs.remove", {"path": "/workspace", "recursive": True}, Outcome.ALLOW, ReasonCode.OK),
        # A command may write /etc (`echo y > /etc/x.conf`), so the file API may too.
        ("fs.write", {"path": "/workspace/../etc/passwd"}, Outcome.ALLOW, ReasonCode.OK),
        ("fs.write", {"path": "/etc/x.conf"}, Outcome.ALLOW, ReasonCode.OK),
        ("fs.remove", {"path": "/usr/local/bin/tool"}, Outcome.ALLOW, ReasonCode.OK),
        (
            "fs.remove",
            {"path": "/usr", "recursive": True},
            Outcome.DENY,
            ReasonCode.POLICY_VIOLATION,
        ),
        (
            "fs.remove",
            {"path": "/workspace/..", "recursive": True},
            Outcome.DENY,
            ReasonCode.POLICY_VIOLATION,
        ),
        ("fs.write", {"path": "/dev/sda"}, Outcome.DENY, ReasonCode.POLICY_VIOLATION),
        ("fs.mkdir", {"path": "/dev/sdz"}, Outcome.DENY, ReasonCode.POLICY_VIOLATION),
        ("fs.write", {"path": "/dev/null"}, Outcome.ALLOW, ReasonCode.OK),
        ("fs.chmod", {"path": "/workspace/run.sh", "mode": 0o755}, Outcome.ALLOW, ReasonCode.OK),
        ("fs.read", {"path": "/etc/os-release"}, Outcome.ALLOW, ReasonCode.OK),
        ("fs.list", {"path": "/"}, Outcome.ALLOW, ReasonCode.OK),
        ("port.expose", {"port": 8080}, Outcome.ALLOW, ReasonCode.OK),
        ("process.signal", {"process_id": "p1", "signal": 15}, Outcome.ALLOW, ReasonCode.OK),
        ("process.list", {"process_id": "", "signal": 0}, Outcome.ALLOW, ReasonCode.OK),
        ("process.output", {"process_id": "p1", "signal": 0}, Outcome.ALLOW, ReasonCode.OK),
        ("process.wait", {"process_id": "p1", "signal": 0}, Outcome.ALLOW, ReasonCode.OK),
        ("process.stdin", {"process_id": "p1", "signal": 0}, Outcome.ALLOW, ReasonCode.OK),
        ("snapshot", {}, Outcome.ALLOW, ReasonCode.OK),
        ("destroy", {}, Outcome.ALLOW, ReasonCode.OK),
        ("sandbox.create", {}, Outcome.ALLOW, ReasonCode.OK),
        ("pty.open", {}, Outcome.ALLOW, ReasonCode.OK),
    ],
)
def test_other_actions(
    engine: PolicyEngine, action: str, args: dict, outcome: Outcome, code: ReasonCode
) -> None:
    d = decide(engine, request(action, **args))
    assert (d.outcome, d.reason_code) == (outcome, code), d


def test_a_device_write_through_the_file_api_is_forbidden_even_when_the_workdir_is_root(
    engine: PolicyEngine,
) -> None:
    sandbox = SANDBOX.model_copy(update={"workdir": "/"})
    d = decide(engine, request("fs.write", resource=sandbox, path="/dev/sda"))
    assert (d.outcome, d.matched) == (Outcome.DENY, ("deny-file-api-device-writes",))
    assert (
        decide(engine, request("fs.write", resource=sandbox, path="/dev/shm/x")).outcome
        is Outcome.ALLOW
    )


# The same write through a command and through the file API: (command template, action, args).
SAME_WRITE = [
    ("echo y > {p}", "fs.write", {}),
    ("printf y >> {p}", "fs.write", {}),
    ("echo y | tee {p}", "fs.write", {}),
    ("cp /workspace/a.txt {p}", "fs.write", {}),
    ("dd if=/dev/zero of={p} count=1", "fs.write", {}),
    ("mkdir {p}", "fs.mkdir", {}),
    ("rm {p}", "fs.remove", {}),
    ("rm -rf {p}", "fs.remove", {"recursive": True}),
    ("chmod 644 {p}", "fs.chmod", {"mode": 0o644}),
]

PATHS = [
    "/workspace/x.py",
    "/workspace/a/b/c.txt",
    "/workspace",
    "/tmp/x",
    "/var/tmp/x",
    "/root/.cache/pip",
    "/home/user/notes",
    "/etc/x.conf",
    "/etc",
    "/usr/local/bin/tool",
    "/usr/local",
    "/usr",
    "/opt/app/config.yaml",
    "/var/lib/x",
    "/var/lib",
    "/proc/sys/kernel/x",
    "/",
    "/dev",
    "/dev/sda",
    "/dev/nvme0n1p1",
    "/dev/null",
    "/dev/shm/x",
    "/dev/pts/0",
    "/workspace/../etc/passwd",
]


Writes = list[tuple[str, str, dict[str, object]]]


def same_write_cases(path: str, writes: Writes = SAME_WRITE) -> Writes:
    return [(t.format(p=path), a, {"path": path, **args}) for t, a, args in writes]


def assert_same_decisions(
    engine: PolicyEngine, path: str, writes: Writes = SAME_WRITE
) -> set[Outcome]:
    """Each write of ``path`` gets one answer through exec and through the file API."""
    seen: set[Outcome] = set()
    for command, action, args in same_write_cases(path, writes):
        by_exec = decide(engine, exec_request(command))
        by_file_api = decide(engine, request(action, **args))
        assert by_exec.outcome is by_file_api.outcome, (command, by_exec, action, by_file_api)
        seen.add(by_exec.outcome)
    return seen


@pytest.mark.parametrize("path", PATHS)
def test_a_write_gets_the_same_decision_through_exec_and_the_file_api(
    engine: PolicyEngine, path: str
) -> None:
    assert_same_decisions(engine, path)


def test_the_write_matrix_has_both_answers(engine: PolicyEngine) -> None:
    # Agreement would be trivial if everything were allowed (or denied): both must occur.
    outcomes = {
        decide(engine, request(a, **args)).outcome
        for path in PATHS
        for _, a, args in same_write_cases(path)
    }
    assert outcomes == {Outcome.ALLOW, Outcome.DENY}


def test_the_file_api_recursive_chmod_twin_fires_when_chmod_is_recursive(
    engine: PolicyEngine,
) -> None:
    # fs.chmod has no recursive form today; the forbid is ready for the day it has one.
    req = request("fs.chmod", path="/etc", mode=0o777)
    recursive = req.model_copy(update={"context": {**req.context, "recursive": True}})
    assert decide(engine, req).outcome is Outcome.ALLOW
    d = decide(engine, recursive)
    assert (d.outcome, d.matched) == (
        Outcome.DENY,
        ("deny-file-api-recursive-chmod-system-dirs",),
    )
    assert decide(engine, exec_request("chmod -R 777 /etc")).outcome is Outcome.DENY


def test_another_tenant_is_denied_everything(engine: PolicyEngine) -> None:
    stranger = Principal(id="agent-9", tenant="other")
    for action, args in [("exec", {"command": "ls"}), ("fs.read", {"path": "/x"}), ("destroy", {})]:
        d = decide(engine, request(action, principal=stranger, **args))
        assert (d.outcome, d.matched) == (Outcome.DENY, ("deny-cross-tenant",)), d
    assert AGENT.tenant == SANDBOX.tenant


def test_the_deny_message_names_the_rule_and_command(engine: PolicyEngine) -> None:
    d = decide(engine, exec_request("ls && rm -rf /"))
    assert "deny-recursive-remove-system-dirs" in d.message
    assert "command 2: rm" in d.message
    err = d.denial(receipt_id="r-1")
    assert err.reason_code == "POLICY_VIOLATION"
    assert err.receipt_id == "r-1"
    assert isinstance(err, PermissionError)


@pytest.mark.parametrize(
    ("action", "args", "rule", "reason"),
    [
        (
            "exec",
            {"command": "ls && rm -rf /"},
            "deny-recursive-remove-system-dirs",
            "recursive removal of / or of a top-level system directory",
        ),
        (
            "fs.remove",
            {"path": "/etc", "recursive": True},
            "deny-file-api-recursive-remove-system-dirs",
            "recursive removal of / or of a top-level system directory",
        ),
        (
            "fs.write",
            {"path": "/dev/sda"},
            "deny-file-api-device-writes",
            "writing to a raw device node through the file API",
        ),
    ],
)
def test_a_forbid_names_its_id_reason_and_where_to_change_it(
    engine: PolicyEngine, action: str, args: dict[str, object], rule: str, reason: str
) -> None:
    d = decide(engine, request(action, **args))
    assert (d.reason_code, d.matched) == (ReasonCode.POLICY_VIOLATION, (rule,))
    shipped = "default.cedar" if engine.name == "cedar" else "builtin_default.toml"
    source = (files("sandlot.policy") / shipped).read_text().splitlines()
    # The line the message names is where the rule starts: its @id, or its [[rule]] header.
    line = int(d.message.rpartition(f"{shipped}:")[2])
    if engine.name == "cedar":
        assert source[line - 1] == f'@id("{rule}")'
    else:
        assert (source[line - 1], source[line]) == ("[[rule]]", f'id = "{rule}"')
    subject = args.get("path", "command 2: rm")
    assert d.message == (
        f"{action} denied by {rule} ({subject}): {reason}; no permit overrides a forbid: "
        f"to allow it, change or remove that forbid at {shipped}:{line}"
    )
