"""A policy file that does not parse or validate: one line naming the file, line and column."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandlot.errors import InvalidRequest
from sandlot.policy import load_engine
from sandlot.policy.builtin import BuiltinEngine
from sandlot.policy.cedar import SCHEMA, CedarEngine
from sandlot.policy.request import ACTIONS
from sandlot.sdk import policy_config

GOOD = '@id("allow-all")\npermit (principal, action, resource);\n'


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_error(*paths: str | Path, schema_path: Path | None = None) -> str:
    """The message loading these policy files fails with (as SANDLOT_POLICY loads them)."""
    config = policy_config([str(p) for p in paths])
    if schema_path is not None:
        config = config.model_copy(update={"schema_path": str(schema_path)})
    with pytest.raises(InvalidRequest) as info:
        load_engine(config)
    message = info.value.message
    assert "\n" not in message
    assert "policy0" not in message  # Cedar's positional id names nothing the user wrote
    return message


def test_a_syntax_error_names_the_file_line_and_column(tmp_path: Path) -> None:
    bad = write(
        tmp_path,
        "my.cedar",
        GOOD + '\n@id("only-ls")\npermit (principal, action, resource)\nwhen { context.x == 1 ;\n',
    )
    assert load_error(bad) == f"{bad}:6:23: the Cedar policy does not parse: unexpected token `;`"


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        # The whole policy is read before Cedar objects to a word: the word is found.
        ("permit (principal, action, resource)\nwhen { foo };", "2:8", "invalid variable: foo"),
        ("allow (principal, action, resource);", "1:1", "invalid policy effect: allow"),
        (
            'permit (principal, action, resource)\nwhen { context.x == "abc };',
            "2:21",
            "invalid token",
        ),
        (
            "// one policy, unfinished\npermit (principal, action, resource)\n",
            "2:37",
            "unexpected end of input (the policy that starts on line 2 is not finished)",
        ),
        (
            'permit (principal, action, resource)\n\n@id("b")\nforbid (principal, action, resource);',
            "3:1",
            "unexpected token `@` (is a `;` missing before line 3, column 1?)",
        ),
    ],
)
def test_each_kind_of_syntax_error_is_placed(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    bad = write(tmp_path, "p.cedar", text)
    assert load_error(bad) == f"{bad}:{where}: the Cedar policy does not parse: {problem}"


def test_a_validation_error_names_the_policy_by_its_id_and_points_at_the_attribute(
    tmp_path: Path,
) -> None:
    bad = write(
        tmp_path,
        "typo.cedar",
        GOOD
        + '\n@id("no-rm")\nforbid (principal, action == Action::"exec", resource)\n'
        + 'when { context.progam == "rm" };\n',
    )
    assert load_error(bad) == (
        f'{bad}:6:16: policy "no-rm" does not validate against the schema: '
        "attribute `progam` in context not found (for exec)"
    )


def test_a_policy_without_an_id_is_named_by_the_line_it_starts_on(tmp_path: Path) -> None:
    bad = write(
        tmp_path,
        "p.cedar",
        GOOD + "\n// no @id\npermit (principal, action, resource)\nwhen { context.progam == 1 };",
    )
    message = load_error(bad)
    assert message.startswith(f"{bad}:6:16: the policy starting on line 5 does not validate")
    assert f"{len(ACTIONS)} actions" in message  # Cedar's one error per action, folded into one


@pytest.mark.parametrize(
    ("policy", "where", "problem"),
    [
        (
            'permit (principal == Foo::"x", action, resource);',
            "2:22",
            "unrecognized entity type `Foo`",
        ),
        (
            'permit (principal, action == Action::"exec", resource)\n'
            'when { principal.nickname == "x" };',
            "3:18",
            "attribute `nickname` on entity type `Agent` not found",
        ),
        (
            'permit (principal, action == Action::"exec", resource)\n'
            'when { resource.owner == "a" && resource.colour == "x" };',
            "3:42",
            "attribute `colour` on entity type `Sandbox` not found",
        ),
        (
            'permit (principal, action == Action::"exe", resource);',
            "2:38",
            'unrecognized action `Action::"exe"`',
        ),
        (
            'permit (principal, action == Action::"exec", resource)\n'
            "when { context.program == 3 };",
            "1:1",
            "the types Long and String are not compatible",
        ),
    ],
)
def test_unknown_entities_attributes_and_actions(
    tmp_path: Path, policy: str, where: str, problem: str
) -> None:
    bad = write(tmp_path, "p.cedar", f'@id("mine")\n{policy}\n')
    message = load_error(bad)
    # A problem with no word to point at is placed where the policy starts (its @id).
    assert message.startswith(f'{bad}:{where}: policy "mine" does not validate')
    assert problem in message


def test_with_several_files_the_error_names_the_right_file_and_its_own_lines(
    tmp_path: Path,
) -> None:
    first = write(tmp_path, "first.cedar", GOOD)
    second = write(
        tmp_path,
        "second.cedar",
        '\n\n@id("x")\nforbid (principal, action, resource) when { context.progam == 1 };\n',
    )
    message = load_error("default", first, second)
    assert message.startswith(f'{second}:4:53: policy "x" does not validate')
    broken = write(tmp_path, "broken.cedar", "permit (principal, action, resource")
    assert load_error("default", first, broken, second).startswith(f"{broken}:1:")
    # An unfinished policy at the end of one file is that file's error, not the next one's.
    unfinished = write(tmp_path, "unfinished.cedar", "permit (principal, action, resource)\n")
    assert load_error(unfinished, first) == (
        f"{unfinished}:1:37: the Cedar policy does not parse: unexpected end of input "
        "(the policy that starts on line 1 is not finished)"
    )


def test_several_policies_that_do_not_validate_are_all_placed(tmp_path: Path) -> None:
    bad = write(
        tmp_path,
        "p.cedar",
        '@id("a") permit (principal, action, resource) when { context.nope };\n'
        'permit (principal, action, resource) when { principal.nope == "" };\n'
        '@id("c") permit (principal, action == Action::"nope", resource);\n',
    )
    message = load_error(bad)
    assert message.startswith(f'{bad}:1:62: policy "a" does not validate')
    assert message.endswith(f"(other policies that do not validate: {bad}:2, {bad}:3 (c))")


def test_a_duplicate_id_names_both_places(tmp_path: Path) -> None:
    one = write(tmp_path, "one.cedar", GOOD)
    two = write(tmp_path, "two.cedar", "// copy\n" + GOOD)
    assert load_error(one, two) == (
        f'{two}:2:1: two Cedar policies share @id("allow-all") (the first is at {one}:1:1)'
    )


def test_hold_on_a_forbid_is_placed(tmp_path: Path) -> None:
    bad = write(tmp_path, "p.cedar", GOOD + '@hold("why")\nforbid (principal, action, resource);')
    assert load_error(bad) == (
        f"{bad}:3:1: @hold is only meaningful on a permit (the policy starting on line 3 is a forbid)"
    )


def test_a_schema_file_that_does_not_parse_is_placed(tmp_path: Path) -> None:
    good = write(tmp_path, "p.cedar", GOOD)
    schema = write(tmp_path, "my.cedarschema", SCHEMA.replace("entity Tenant;", "entity Tenant"))
    assert load_error(good, schema_path=schema) == (
        f"{schema}:7:1: the Cedar schema does not parse: unexpected token `entity`"
    )
    lines = SCHEMA.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("entity Agent")) + 1
    typo = write(
        tmp_path,
        "typo.cedarschema",
        SCHEMA.replace("tenant: String, roles", "tenant: Strng, roles"),
    )
    message = load_error(good, schema_path=typo)
    assert message.startswith(f"{typo}:{row}:")
    assert "Strng" in message


def test_sandlot_policy_from_the_environment_reports_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = write(tmp_path, "first.cedar", GOOD)
    bad = write(tmp_path, "bad.cedar", "permit (principal, action, resource) when { 1 + };")
    monkeypatch.setenv("SANDLOT_POLICY", f"{first}:{bad}")
    with pytest.raises(InvalidRequest, match=rf"^{bad}:1:49: the Cedar policy does not parse"):
        load_engine(policy_config(None))


def test_the_cli_prints_one_line_naming_the_file(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.cedar", GOOD + "permit (principal, action, resource) when { foo };")
    env = {**os.environ, "SANDLOT_BACKEND": "fake", "SANDLOT_POLICY": str(bad), "COLUMNS": "300"}
    proc = subprocess.run(
        [sys.executable, "-m", "sandlot", "policy", "explain", "sb-1", "--", "ls"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad}:3:45: the Cedar policy does not parse: invalid variable: foo"
    ]


def test_plain_text_is_called_policies(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match=r"^<policies>:1:37: the Cedar policy does not parse"):
        CedarEngine("permit (principal, action, resource)")


def test_builtin_rule_files_name_the_file_and_the_rule_line(tmp_path: Path) -> None:
    rules = write(
        tmp_path,
        "rules.toml",
        'default = "deny"\n\n[[rule]]\nid = "ok"\neffect = "permit"\n\n'
        '[[rule]]\nid = "typo"\neffect = "permit"\nactions = ["read"]\nwhen = { progam = "ls" }\n',
    )
    with pytest.raises(InvalidRequest) as info:
        BuiltinEngine.from_file(rules)
    assert info.value.message.startswith(f"{rules}:7: rule 'typo': action ")
    broken = write(tmp_path, "broken.toml", "[[rule]\n")
    with pytest.raises(InvalidRequest, match=rf"^{broken}: builtin rules do not parse: .*line 1"):
        BuiltinEngine.from_file(broken)
