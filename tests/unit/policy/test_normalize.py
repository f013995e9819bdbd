"""Normalization: every spelling of a command reaches policy as the same command."""

from __future__ import annotations

import posixpath
import shlex
import time

import pytest
import rfc8785
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandlot.errors import InvalidRequest
from sandlot.models import CommandSpec, SandboxSpec
from sandlot.policy import normalize_command, normalize_operation, normalize_path
from sandlot.policy.normalize import ancestors

from .conftest import AGENT, SANDBOX


def commands(command: str | list[str] | CommandSpec, **kw: object) -> list[dict]:
    return normalize_command(command, **kw)["commands"]  # type: ignore[arg-type,return-value]


def only(command: str | list[str], program: str = "rm", **kw: object) -> dict:
    found = [c for c in commands(command, **kw) if c["program"] == program]
    assert len(found) == 1, found
    return found[0]


def core(c: dict) -> tuple:
    return (c["program"], c["flags"], c["paths"], c["writes"], c["glob_dirs"])


ROOT_RM = ("rm", ["force", "recursive"], ["/"], ["/"], [])

SAME_AS_RM_RF_ROOT = [
    "rm -rf /",
    "rm -fr /",
    "rm -r -f /",
    "rm -R -f /",
    "rm -f -r //",
    "/bin/rm --recursive --force /",
    "/usr/bin/rm --force --recursive /.",
    "rm --rec --forc /",  # getopt_long accepts unambiguous prefixes
    "rm / -rf",  # GNU getopt permutes
    "rm -rf -- /",
    "rm -rf '/'",
    '"rm" -rf "/"',
    "\\rm -rf /",
    "r''m -rf /",
    "rm -rf /../..",
    "rm -rf /tmp/..",
    "rm -rf ///.//",
    "sh -c 'rm -rf /'",
    'bash -lc "rm -rf /"',
    "dash -c 'rm -rf /'",
    "bash -e -o pipefail -c 'rm -rf /'",
    "sh -c 'cd / && rm -rf .'",
    "cd / && rm -rf .",
    "sudo rm -rf /",
    "sudo -u root -- rm -rf /",
    "env FOO=bar rm -rf /",
    "env -i PATH=/bin rm -rf /",
    "env -S 'rm -rf /'",
    "nice -n 10 rm -rf /",
    "nice -5 rm -rf /",
    "nohup rm -rf /",
    "timeout 10 rm -rf /",
    "timeout -s KILL 5s rm -rf /",
    "exec rm -rf /",
    "command rm -rf /",
    "busybox rm -rf /",
    "stdbuf -oL rm -rf /",
    "setsid rm -rf /",
    "time rm -rf /",
    "xargs rm -rf /",
    "su -c 'rm -rf /' root",
    "sudo env FOO=1 nice -n 5 timeout 10 busybox rm --rec --forc /.",
    "eval 'rm -rf /'",
    "echo $(rm -rf /)",
    "echo `rm -rf /`",
    "true && (rm -rf /)",
    "if true; then rm -rf /; fi",
    "FOO=1 rm -rf /",
    "bash <<< 'rm -rf /'",
    "bash <<'EOF'\nrm -rf /\nEOF",
    "sh -c \"bash -c 'rm -rf /'\"",
]


@pytest.mark.parametrize("spelling", SAME_AS_RM_RF_ROOT)
def test_every_spelling_of_rm_rf_root_is_the_same_command(spelling: str) -> None:
    assert core(only(spelling, cwd="/workspace")) == ROOT_RM


def test_argv_form_is_the_same_command_as_the_string() -> None:
    assert core(only(["/bin/rm", "-r", "-f", "/"])) == ROOT_RM
    assert core(only(["bash", "-lc", "rm -rf /"])) == ROOT_RM
    assert core(only(["sudo", "env", "rm", "--recursive", "--force", "//"])) == ROOT_RM


def test_glob_under_root_reports_root_as_the_glob_dir() -> None:
    c = only("rm -fr /*")
    assert c["flags"] == ["force", "recursive"]
    assert c["glob_dirs"] == ["/"]
    assert only("rm -rf /usr/*")["glob_dirs"] == ["/usr"]
    assert only("rm -rf /./*")["glob_dirs"] == ["/"]
    # Quoted, the star is a literal file name, not a pattern.
    assert only("rm -rf '/*'")["glob_dirs"] == []


def test_relative_paths_resolve_against_cwd_and_cd() -> None:
    assert only("rm -rf build", cwd="/workspace")["paths"] == ["/workspace/build"]
    assert only("cd /tmp && rm -rf x", cwd="/workspace")["paths"] == ["/tmp/x"]
    # After "cd X;" the cd may have failed, so both directories are possible.
    assert only("cd /tmp; rm -rf x", cwd="/workspace")["paths"] == ["/tmp/x", "/workspace/x"]
    # A subshell's cd does not leak out.
    assert only("(cd /tmp) && rm -rf x", cwd="/workspace")["paths"] == ["/workspace/x"]
    assert only("env -C /srv rm -rf x", cwd="/workspace")["paths"] == ["/srv/x"]


def test_brace_expansion_is_static() -> None:
    ctx = normalize_command("rm -rf /{usr,etc}")
    assert ctx["commands"][0]["paths"] == ["/etc", "/usr"]  # type: ignore[index,call-overload]
    assert "brace" in ctx["shell_features"]  # type: ignore[operator]
    assert ctx["shell_undecidable"] is False
    assert only("rm -rf /x{1..3}")["paths"] == ["/x1", "/x2", "/x3"]


def test_combined_short_flags_are_split_in_args() -> None:
    assert only("rm -rfv /tmp/x")["args"] == ["-r", "-f", "-v", "/tmp/x"]
    assert only("rm -rfv /tmp/x")["flags"] == ["force", "recursive", "verbose"]


@pytest.mark.parametrize(
    ("command", "program", "device_writes"),
    [
        ("dd if=/dev/zero of=/dev/sda bs=1M", "dd", ["/dev/sda"]),
        ("cat img > /dev/sda", "cat", ["/dev/sda"]),
        ("echo x >> /dev/vda1 2>/dev/null", "echo", ["/dev/vda1"]),
        ("mkfs.ext4 -L root /dev/sda1", "mkfs.ext4", ["/dev/sda1"]),
        ("mkfs -t ext4 /dev/sdb", "mkfs", ["/dev/sdb"]),
        ("shred -n 3 -z /dev/sda", "shred", ["/dev/sda"]),
        ("wipefs -a /dev/sda", "wipefs", ["/dev/sda"]),
        ("tee /dev/sda < img", "tee", ["/dev/sda"]),
        ("cp disk.img /dev/sdc", "cp", ["/dev/sdc"]),
        ("curl -o /dev/sda http://x/img", "curl", ["/dev/sda"]),
        ("dd if=/dev/sda of=/tmp/backup.img", "dd", []),
        ("echo hi > /dev/null 2>&1", "echo", []),
        ("wipefs -n /dev/sda", "wipefs", []),
        ("fdisk -l /dev/sda", "fdisk", []),
    ],
)
def test_device_writes(command: str, program: str, device_writes: list[str]) -> None:
    assert only(command, program)["device_writes"] == device_writes


@pytest.mark.parametrize(
    "path",
    [
        "/dev/sda",
        "/dev/nvme0n1p1",
        "/dev/mapper/root",
        "/dev/null",
        "/dev/shm/x",
        "/dev/fd/3",
        "/dev/pts/0",
        "/dev/urandom",
        "/dev",
        "/dev/shm",
        "/workspace/dev/sda",
        "/tmp/x",
    ],
)
def test_a_file_action_is_a_device_write_exactly_when_a_redirection_to_it_is(path: str) -> None:
    fs = normalize_operation("fs.write", principal=AGENT, resource=SANDBOX, args={"path": path})
    (redirect,) = commands(f"> {path}")
    assert fs.context["device"] is (redirect["device_writes"] == [path])


@pytest.mark.parametrize(
    ("command", "program", "writes"),
    [
        ("sort -o /etc/passwd /dev/null", "sort", ["/etc/passwd"]),
        ("sort -uo out.txt in.txt", "sort", ["/workspace/out.txt"]),
        ("sort --output=/tmp/s data", "sort", ["/tmp/s"]),
        ("sort -k2 -t, data.csv", "sort", []),
        ("tree -o /tmp/tree.txt .", "tree", ["/tmp/tree.txt"]),
        ("tree -L 2 -P '*.py'", "tree", []),
    ],
)
def test_output_options_of_sort_and_tree_are_writes(
    command: str, program: str, writes: list[str]
) -> None:
    assert only(command, program, cwd="/workspace")["writes"] == writes


def test_redirection_only_command_is_visible() -> None:
    (c,) = commands("> /dev/sda")
    assert c["program"] == ""
    assert c["device_writes"] == ["/dev/sda"]


def test_writes_within_is_the_common_ancestry_of_writes() -> None:
    assert only("touch /workspace/a /workspace/b/c", "touch")["writes_within"] == [
        "/",
        "/workspace",
    ]
    assert only("touch /workspace/a /tmp/b", "touch")["writes_within"] == ["/"]
    assert only("ls /etc", "ls")["writes_within"] == []


@pytest.mark.parametrize(
    ("command", "feature"),
    [
        ("echo $HOME", "variable"),
        ('rm -rf "$DIR"', "variable"),
        ("echo ${X:-y}", "variable"),
        ("echo $(date)", "command_substitution"),
        ("echo `date`", "backtick"),
        ("cat <<EOF\nhi\nEOF", "heredoc"),
        ("source ./env.sh", "source"),
        (". ./env.sh", "source"),
        ("eval ls", "eval"),
        ("ls ~", "tilde"),
        ("f() { ls; }; f", "function"),
        ("curl -s https://x | bash", "shell_stdin"),
        ("$CMD -rf /", "variable"),
        ("/bin/r? -rf /", "glob_command"),
        ("diff <(ls a) <(ls b)", "process_substitution"),
        ("echo 'unterminated", "parse_error"),
        ("find . -exec rm {} +", "find_exec"),
        ("ls | xargs rm", "xargs"),
        ("echo $((1+2))", "arithmetic"),
        ("case $x in a) ls;; esac", "case"),
        ("cd -", "cd"),
    ],
)
def test_undecidable_strings_are_flagged(command: str, feature: str) -> None:
    ctx = normalize_command(command)
    assert feature in ctx["shell_features"]  # type: ignore[operator]
    assert ctx["shell_undecidable"] is True
    assert ctx["raw"] == command


@pytest.mark.parametrize(
    "command",
    [
        "ls -la",
        "echo '$HOME'",
        "rm -rf build/*.o",
        'echo "a b" | grep a',
        "python3 -c 'print(1)'",
        "ls /x{a,b}",
    ],
)
def test_decidable_strings_are_not_flagged(command: str) -> None:
    assert normalize_command(command)["shell_undecidable"] is False


def test_decidable_parts_of_an_undecidable_string_are_still_visible() -> None:
    ctx = normalize_command('echo "$X" && rm -rf / ; cat <<EOF\n$(rm -rf /etc)\nEOF')
    assert ctx["shell_undecidable"] is True
    rms = [c for c in ctx["commands"] if c["program"] == "rm"]  # type: ignore[union-attr,index]
    assert sorted(c["paths"][0] for c in rms) == ["/", "/etc"]  # type: ignore[index]


def test_tilde_resolves_with_a_known_home() -> None:
    ctx = normalize_command("rm -rf ~/.cache ~", env={"HOME": "/root"})
    assert ctx["shell_undecidable"] is False
    assert ctx["commands"][0]["paths"] == ["/root", "/root/.cache"]  # type: ignore[index,call-overload]


def test_wrappers_and_shells_are_listed_in_via_and_programs() -> None:
    ctx = normalize_command(["sudo", "bash", "-c", "env rm -rf /tmp/x"])
    (c,) = ctx["commands"]  # type: ignore[misc]
    assert c["via"] == ["sudo", "bash", "env"]
    assert ctx["programs"] == ["bash", "env", "rm", "sudo"]
    assert ctx["shell"] is True


def test_flag_tables_know_which_arguments_take_values() -> None:
    c = only("chmod --reference=/etc/passwd -R /workspace", "chmod")
    assert c["paths"] == ["/etc/passwd", "/workspace"]
    assert c["writes"] == ["/workspace"]
    c = only("chmod -w file", "chmod")  # "-w" is a mode, not an option
    assert c["flags"] == []
    assert c["writes"] == ["/file"]
    c = only("sed -i.bak -e s/a/b/ /etc/hosts", "sed")
    assert c["writes"] == ["/etc/hosts"]
    assert only("sed s/a/b/ /etc/hosts", "sed")["writes"] == []
    c = only("cp -t /dst a b", "cp")
    assert c["writes"] == ["/dst"]
    c = only("mv /a /b", "mv")
    assert c["writes"] == ["/a", "/b"]


def test_find_delete_and_exec() -> None:
    c = only("find / -name '*.tmp' -delete", "find")
    assert "delete" in c["flags"]
    assert c["paths"] == ["/"]
    assert c["writes"] == ["/"]
    ctx = normalize_command("find /srv -exec rm -rf {} +")
    rm = next(c for c in ctx["commands"] if c["program"] == "rm")  # type: ignore[union-attr,index]
    assert rm["flags"] == ["force", "recursive"]
    assert rm["via"] == ["sh", "find"]


def test_command_spec_cwd_and_env_win() -> None:
    ctx = normalize_command(
        CommandSpec(cmd="rm", args=["-rf", "x"], cwd="/srv", env={"A": "1"}), cwd="/workspace"
    )
    assert ctx["cwd"] == "/srv"
    assert ctx["env"] == ["A"]
    assert ctx["commands"][0]["paths"] == ["/srv/x"]  # type: ignore[index,call-overload]
    assert ctx["shell"] is False


def test_bad_commands_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequest):
        normalize_command([])
    with pytest.raises(InvalidRequest):
        normalize_command("ls", cwd="relative")
    with pytest.raises(InvalidRequest):
        normalize_command(["ls", "a\x00b"])


def test_normalize_path() -> None:
    assert normalize_path("//") == "/"
    assert normalize_path("/a//b/./c/../d/") == "/a/b/d"
    assert normalize_path("../x", "/a/b") == "/a/x"
    assert normalize_path("/..") == "/"
    assert ancestors("/a/b") == ["/", "/a", "/a/b"]


def test_fs_operations_normalize_paths_and_list_ancestors() -> None:
    req = normalize_operation(
        "fs.write", principal=AGENT, resource=SANDBOX, args={"path": "/workspace/./a//b/../c"}
    )
    assert req.context == {
        "path": "/workspace/a/c",
        "within": ["/", "/workspace", "/workspace/a", "/workspace/a/c"],
        "recursive": False,
        "device": False,
    }
    with pytest.raises(InvalidRequest):
        normalize_operation("fs.read", principal=AGENT, resource=SANDBOX, args={"path": "relative"})
    with pytest.raises(InvalidRequest):
        normalize_operation(
            "fs.chmod", principal=AGENT, resource=SANDBOX, args={"path": "/x", "mode": "755"}
        )


def test_every_action_normalizes_to_canonical_json() -> None:
    args: dict[str, dict[str, object]] = {
        "sandbox.create": {"spec": SandboxSpec(ports=[8080], network="deny-all")},
        "exec": {"command": "ls"},
        "process.start": {"command": ["sleep", "10"]},
        "pty.open": {},
        "exec.program": {"command": ["/usr/bin/rm", "-rf", "/"]},
        "process.signal": {"process_id": "p1", "signal": 9},
        "fs.chmod": {"path": "/workspace/x", "mode": 0o755},
        "port.expose": {"port": 8080},
        "network.update": {"network": {"allow_domains": ["example.com"]}},
        "fork": {"count": 3},
    }
    from sandlot.policy import ACTIONS

    for action, info in ACTIONS.items():
        a = args.get(action, {"path": "/workspace/x"} if info.kind in ("path",) else {})
        req = normalize_operation(action, principal=AGENT, resource=SANDBOX, args=a)
        encoded = rfc8785.dumps(req.canonical())
        assert encoded == rfc8785.dumps(req.canonical())
        assert b'"action":"' + action.encode() + b'"' in encoded


def test_unknown_action_is_invalid() -> None:
    with pytest.raises(InvalidRequest):
        normalize_operation("format.disk", principal=AGENT, resource=SANDBOX)


# -- property tests ------------------------------------------------------------------------------

RECURSIVE = ["-r", "-R", "--recursive", "--recur"]
FORCE = ["-f", "--force", "--forc"]
PROGRAMS = [
    "rm",
    "/bin/rm",
    "/usr/bin/rm",
    "busybox rm",
    "sudo rm",
    "env rm",
    "command rm",
    "nice rm",
    "timeout 5 rm",
]


@st.composite
def root_spellings(draw: st.DrawFn) -> str:
    """A spelling of "/" made of ., .., empty components and detours."""
    pieces = st.sampled_from(["", ".", "..", "tmp/..", "usr/../.", "a/b/../.."])
    path = "/".join(["", *draw(st.lists(pieces, max_size=5))])
    return path if path.startswith("/") else "/"


@st.composite
def rm_rf_root(draw: st.DrawFn) -> str:
    path = draw(root_spellings())
    if draw(st.booleans()):
        cluster = draw(st.sampled_from(["-rf", "-fr", "-Rf", "-fR"]))
        flags = [cluster]
    else:
        flags = [draw(st.sampled_from(RECURSIVE)), draw(st.sampled_from(FORCE))]
        flags = draw(st.permutations(flags))
    program = draw(st.sampled_from(PROGRAMS))
    quoted = shlex.quote(path)
    placement = draw(st.sampled_from(["before", "after", "dashdash"]))
    if placement == "before":
        words = [program, *flags, quoted]
    elif placement == "after":
        words = [program, quoted, *flags]
    else:
        words = [program, *flags, "--", quoted]
    command = " ".join(words)
    wrap = draw(st.sampled_from(["plain", "sh", "bash", "nested", "cd"]))
    if wrap == "sh":
        return f"sh -c {shlex.quote(command)}"
    if wrap == "bash":
        return f"bash -lc {shlex.quote(command)}"
    if wrap == "nested":
        return f"sh -c {shlex.quote('bash -c ' + shlex.quote(command))}"
    if wrap == "cd":
        return f"cd {quoted} && {' '.join([program, *flags, '.'])}"
    return command


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rm_rf_root())
def test_random_spellings_of_rm_rf_root_normalize_identically(command: str) -> None:
    assert core(only(command, cwd="/workspace")) == ROOT_RM


@settings(max_examples=200, deadline=None)
@given(
    cwd=st.lists(st.sampled_from(["a", "b", "..", ".", ""]), max_size=4).map(
        lambda p: normalize_path("/" + "/".join(p))
    ),
    rel=st.lists(st.sampled_from(["x", "y", "..", ".", ""]), min_size=1, max_size=4).map("/".join),
)
def test_relative_targets_resolve_like_posix(cwd: str, rel: str) -> None:
    if not rel.strip("/"):
        rel = "."
    expected = normalize_path(posixpath.join(cwd, rel))
    assert only(["rm", "-rf", rel], cwd=cwd)["paths"] == [expected]


SAFE_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)


@settings(max_examples=300, deadline=None)
@given(
    program=st.sampled_from(["ls", "cat", "grep", "python3", "git", "make"]),
    args=st.lists(SAFE_TEXT, max_size=5),
)
def test_a_quoted_argv_reads_back_as_the_same_argv(program: str, args: list[str]) -> None:
    """shlex.join(argv) through our shell reader gives the argv itself (quoting is exact)."""
    direct = commands([program, *args])[0]
    via_shell = commands(shlex.join([program, *args]))[0]
    assert via_shell["args"] == direct["args"] == args
    assert via_shell["paths"] == direct["paths"]


@settings(max_examples=500, deadline=None)
@given(
    st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=200)
)
def test_any_string_normalizes_to_canonical_json(text: str) -> None:
    ctx = normalize_command(text)
    rfc8785.dumps(ctx)  # only JSON types; canonical encoding never fails
    assert ctx["raw"] == text


def test_normalization_is_linear_on_long_input() -> None:
    long_word = "a" * 40_000  # three of them stay under MAX_ARG_BYTES
    started = time.perf_counter()
    normalize_command(f"echo {long_word} '{long_word}' \"{long_word}\"")
    normalize_command("true; " * 1_000 + "rm -rf /")  # under MAX_COMMANDS
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize(
    "source",
    [
        "(" * 16_000,  # under MAX_WORDS
        ")" * 16_000,
        "$(" * 20_000,
        '"$(' * 5_000,
        "`" * 10_001,
        "a=(" * 5_000,
        "(" * 300 + "rm -rf /" + ")" * 300,
        "{a,b}" * 40,
        "if " * 10_000,
    ],
)
def test_pathological_strings_stay_cheap_and_never_crash(source: str) -> None:
    started = time.perf_counter()
    ctx = normalize_command(source)
    assert time.perf_counter() - started < 3
    assert ctx["shell_undecidable"] or not source.startswith(("(", "$", '"', "`"))
    if "rm -rf /" in source:
        assert any(c["paths"] == ["/"] for c in ctx["commands"])  # type: ignore[union-attr,index]


def test_trap_and_alias() -> None:
    ctx = normalize_command("trap 'rm -rf /' EXIT; alias ls='rm -rf /etc'")
    assert {"trap", "alias"} <= set(ctx["shell_features"])  # type: ignore[arg-type]
    assert ctx["shell_undecidable"] is True
    assert ["/"] in [c["paths"] for c in ctx["commands"]]  # type: ignore[union-attr,index]
