"""Turning command-line options into a :class:`SandboxSpec`.

``create`` and ``run`` take every spec field as an option, or a whole spec from ``--spec
FILE`` (JSON or TOML) with options laid over it (the options themselves are declared in
:mod:`sandlot.cli.options`). Bad input becomes one ``InvalidRequest`` naming the option; backend
options are checked against what each backend declares (:mod:`sandlot.backends.options`). The
wire models and the backends' tables are imported when a spec is built, not with this module:
``parse_pairs`` serves commands that build no spec. This module must not import concrete
backends.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from sandlot.errors import InvalidRequest

if TYPE_CHECKING:
    from sandlot.models import SandboxSpec

__all__ = ["parse_pairs", "spec_from_options"]


def parse_pairs(values: list[str] | None, option: str) -> dict[str, str]:
    """``["K=V", …]`` as a dict; a missing ``=`` is an error naming the option."""
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            msg = f"{option} expects KEY=VALUE, got {item!r}"
            raise InvalidRequest(msg)
        out[key] = value
    return out


def _load_spec_file(path: Path) -> dict[str, object]:
    try:
        text = path.read_text()
    except OSError as e:
        msg = f"--spec: cannot read {path}: {e.strerror}"
        raise InvalidRequest(msg) from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        msg = f"--spec: {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {e}"
        raise InvalidRequest(msg) from None
    if not isinstance(data, dict):
        msg = f"--spec: {path} must hold an object"
        raise InvalidRequest(msg)
    return data


def _network(
    value: str | None, allow_domains: list[str], allow_cidrs: list[str], deny_cidrs: list[str]
) -> object:
    if allow_domains or allow_cidrs or deny_cidrs:
        if value not in (None, "allowlist"):
            msg = "--network must be 'allowlist' (or omitted) with --allow-domain/--allow-cidr/--deny-cidr"
            raise InvalidRequest(msg)
        return {
            "allow_domains": allow_domains,
            "allow_cidrs": allow_cidrs,
            "deny_cidrs": deny_cidrs,
        }
    if value is None:
        return None
    if value.startswith("{"):
        try:
            return json.loads(value)
        except ValueError:
            msg = f"--network: not valid JSON: {value!r}"
            raise InvalidRequest(msg) from None
    return value


def _backend_options(values: list[str] | None) -> dict[str, dict[str, object]]:
    from sandlot.backends.options import check_backend_options

    out: dict[str, dict[str, object]] = {}
    for key, raw in parse_pairs(values, "--option").items():
        backend, dot, name = key.partition(".")
        if not dot or not backend or not name:
            msg = f"--option expects BACKEND.KEY=VALUE, got {key!r}"
            raise InvalidRequest(msg)
        try:
            value: object = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(backend, {})[name] = value
    check_backend_options(out, flag="--option")
    return out


def spec_from_options(v: dict[str, object]) -> SandboxSpec:
    """The spec the options (by parameter name) describe: ``--spec`` file first, options
    over it."""
    from sandlot.backends.options import check_backend_options
    from sandlot.models import SandboxSpec, parse_model

    spec_file = v.get("spec")
    base: dict[str, object] = _load_spec_file(spec_file) if isinstance(spec_file, Path) else {}
    fields: dict[str, object] = {}

    def put(name: str, value: object) -> None:
        if value is not None and value != [] and value != {}:
            fields[name] = value

    put("image", v.get("image"))
    put("workdir", v.get("workdir"))
    put("env", {**_dict(base.get("env")), **parse_pairs(_list(v.get("env")), "--env")} or None)
    put(
        "labels",
        {**_dict(base.get("labels")), **parse_pairs(_list(v.get("label")), "--label")} or None,
    )
    put(
        "network",
        _network(
            _str(v.get("network")),
            _list(v.get("allow_domain")),
            _list(v.get("allow_cidr")),
            _list(v.get("deny_cidr")),
        ),
    )
    put("timeout", v.get("timeout"))
    put("idle_timeout", v.get("idle_timeout"))
    setup = _list(v.get("setup"))
    put("setup", setup if len(setup) != 1 else setup[0])
    put("start", v.get("start"))
    put("resume", v.get("resume"))
    put("ports", v.get("port"))
    put("owner", v.get("owner"))
    put("ca_certificates", _ca_certificates(base.get("ca_certificates"), _list(v.get("ca_cert"))))
    resources = {
        k: val
        for k, val in (
            ("vcpus", v.get("cpus")),
            ("memory_mb", v.get("memory")),
            ("pids", v.get("pids")),
            ("disk_mb", v.get("disk")),
        )
        if val is not None
    }
    put("resources", {**_dict(base.get("resources")), **resources} or None)
    git_options = {
        k: val
        for k, val in (
            ("revision", v.get("git_revision")),
            ("depth", v.get("git_depth")),
            ("auth", v.get("git_auth") or None),
        )
        if val is not None
    }
    if v.get("git") is not None:
        put("git", {"url": v["git"], **git_options})
    elif isinstance(base.get("git"), dict):
        put("git", {**_dict(base.get("git")), **git_options} if git_options else None)
    else:
        _refuse_git_options_without_a_repository(v)
    options = _backend_options(_list(v.get("option")))
    from_file = {k: _dict(val) for k, val in _dict(base.get("backend_options")).items()}
    try:
        check_backend_options(from_file)
    except InvalidRequest as e:
        msg = f"--spec: {e.message}"
        raise InvalidRequest(msg) from None
    if options:
        merged = {k: dict(val) for k, val in from_file.items()}
        for backend, values in options.items():
            merged.setdefault(backend, {}).update(values)
        put("backend_options", merged)
    return parse_model(SandboxSpec, {**base, **fields})


def _ca_certificates(from_file: object, given: list[str]) -> list[object] | None:
    """The spec file's certificates, then each ``--ca-cert``'s, read here: a file names a path
    on this machine, which the sandbox's host (a server) may not have."""
    if not given:
        return None
    from sandlot.backends import trust

    out: list[object] = list(from_file) if isinstance(from_file, list) else []
    for item in given:
        if item == trust.HOST:
            out.extend(trust.host_certificates(source=f"--ca-cert {trust.HOST}"))
            continue
        path = Path(item).expanduser()
        try:
            text = path.read_text(errors="replace")
        except OSError as e:
            msg = f"--ca-cert {item}: cannot read it: {e.strerror or e}"
            raise InvalidRequest(msg) from None
        out.extend(trust.certificates_in(text, f"--ca-cert {item}"))
    return out


def _refuse_git_options_without_a_repository(v: dict[str, object]) -> None:
    """``--git-revision``, ``--git-depth`` or ``--git-auth`` with nothing to clone would be
    ignored; say so instead. ``$SANDLOT_GIT_AUTH`` alone is fine: it is set for every create."""
    given = [
        flag
        for flag, name in (("--git-revision", "git_revision"), ("--git-depth", "git_depth"))
        if v.get(name) is not None
    ]
    # The option reads $SANDLOT_GIT_AUTH too: the same value as there is the ambient one.
    if v.get("git_auth") and v.get("git_auth") != os.environ.get("SANDLOT_GIT_AUTH"):
        given.append("--git-auth")
    if given:
        needs = "needs" if len(given) == 1 else "need"
        msg = f"{' and '.join(given)} {needs} a repository to clone: add --git URL (or a --spec file with git)"
        raise InvalidRequest(msg)


def _list(value: object) -> list[str]:
    return [str(x) for x in value] if isinstance(value, list) else []


def _dict(value: object) -> dict[str, object]:
    return dict(value) if isinstance(value, dict) else {}


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None
