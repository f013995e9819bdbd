"""The shipped default policy, on both engines, against a table of commands."""

from __future__ import annotations

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
        (
            "fs.write",
            {"path": "/workspace/../etc/passwd"},
            Outcome.DENY,
            ReasonCode.NO_MATCHING_PERMIT,
        ),
        ("fs.write", {"path": "/etc/passwd"}, Outcome.DENY, ReasonCode.NO_MATCHING_PERMIT),
        (
            "fs.remove",
            {"path": "/usr", "recursive": True},
            Outcome.DENY,
            ReasonCode.NO_MATCHING_PERMIT,
        ),
        ("fs.write", {"path": "/dev/sda"}, Outcome.DENY, ReasonCode.POLICY_VIOLATION),
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
