"""The static shell reader: quoting, operators, redirections, here-documents."""

from __future__ import annotations

from sandlot.policy import shell


def simple(source: str) -> list[shell.SimpleCommand]:
    out: list[shell.SimpleCommand] = []

    def walk(body: list[shell.SimpleCommand | shell.Subshell]) -> None:
        for node in body:
            if isinstance(node, shell.Subshell):
                walk(node.body)
            else:
                out.append(node)

    walk(shell.parse(source).body)
    return out


def words(source: str) -> list[list[str]]:
    return [[w.text for w in c.words] for c in simple(source)]


def test_operators_split_commands() -> None:
    assert words("a; b && c || d | e & f\ng") == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"], ["g"]]
    assert [c.sep for c in simple("a && b; c")] == ["&&", ";", ""]


def test_quoting_is_removed_and_remembered() -> None:
    (cmd,) = simple("echo 'a b' \"c $X\" d\\ e $'f\\tg' \"\"")
    texts = [w.text for w in cmd.words]
    assert texts == ["echo", "a b", "c $X", "d e", "f\tg", ""]
    assert [w.expansion for w in cmd.words] == [False, False, True, False, False, False]


def test_glob_only_when_unquoted() -> None:
    (cmd,) = simple("ls *.py '*.txt' \"a?\" b\\*")
    assert [w.glob for w in cmd.words] == [False, True, False, False, False]


def test_io_numbers_and_fd_duplication() -> None:
    (cmd,) = simple("make 2>err.log >&2 1>>out 2>&1")
    assert [(r.fd, r.op, r.target.text if r.target else None) for r in cmd.redirects] == [
        ("2", ">", "err.log"),
        (None, ">&", "2"),
        ("1", ">>", "out"),
        ("2", ">&", "1"),
    ]
    assert [w.text for w in cmd.words] == ["make"]


def test_heredoc_body_is_data_not_commands() -> None:
    cmds = simple("cat <<'EOF' > /tmp/x\nrm -rf /\nEOF\necho done")
    assert [[w.text for w in c.words] for c in cmds] == [["cat"], ["echo", "done"]]
    assert cmds[0].redirects[0].body == ["rm -rf /"]


def test_unquoted_heredoc_substitutions_run() -> None:
    assert ["rm", "-rf", "/x"] in words("cat <<EOF\n$(rm -rf /x)\nEOF")
    assert ["rm", "-rf", "/x"] not in words("cat <<'EOF'\n$(rm -rf /x)\nEOF")


def test_substitutions_run_before_their_command() -> None:
    assert words("echo $(id -u) `whoami`") == [
        ["id", "-u"],
        ["whoami"],
        ["echo", "$(id -u)", "`whoami`"],
    ]
    assert words("x=$(rm -rf /a) ls") == [["rm", "-rf", "/a"], ["ls"]]


def test_reserved_words_are_skipped() -> None:
    assert words("if test -f x; then rm x; elif true; then :; else ls; fi") == [
        ["test", "-f", "x"],
        ["rm", "x"],
        ["true"],
        [":"],
        ["ls"],
    ]
    assert words("while read l; do echo $l; done") == [["read", "l"], ["echo", "$l"]]
    assert words("for f in a b; do rm $f; done") == [["rm", "$f"]]


def test_comments_and_line_continuations() -> None:
    assert words("ls # rm -rf /\necho a\\\nb") == [["ls"], ["echo", "ab"]]
    assert words("echo a#b") == [["echo", "a#b"]]


def test_brace_expansion() -> None:
    (cmd,) = simple("echo /{a,b{1,2}}/x {3..1} {} {x}")
    expanded = [w.text for word in cmd.words for w in shell.expand_braces(word)]
    assert expanded == ["echo", "/a/x", "/b1/x", "/b2/x", "3", "2", "1", "{}", "{x}"]
    (quoted,) = simple("echo '{a,b}'")
    assert [w.text for w in shell.expand_braces(quoted.words[1])] == ["{a,b}"]


def test_deep_nesting_is_cut_off() -> None:
    source = "echo hi"
    for _ in range(shell.MAX_DEPTH + 2):
        source = f"echo $({source})"
    assert "too_deep" in shell.parse(source).features
