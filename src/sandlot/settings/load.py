"""Every effective setting, and where each came from: flag > environment > file > default.

:func:`load_settings` reads ``sandlot.toml`` (``--config``, else ``$SANDLOT_CONFIG``, else the
file of that name in the home; only the last may be missing), lays the environment and the
command-line flags over it, validates the result against :mod:`sandlot.settings.schema`, and
records for every leaf whether it is the default, the file's, an environment variable's or a
flag's. A file that is not TOML, a key no table declares or a value of the wrong type is one
:class:`~sandlot.errors.InvalidRequest` naming the file (or variable, or flag) and the key.

This module imports only the standard library, pydantic, the schema and the state-directory
helpers; building anything from the settings is :mod:`sandlot.wiring`'s job.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import final

from pydantic import ValidationError

from sandlot.config import home as resolve_home
from sandlot.errors import InvalidRequest
from sandlot.settings.schema import SettingsModel

__all__ = ["CONFIG_FILE", "ENVIRONMENT", "Settings", "load_settings"]

CONFIG_FILE = "sandlot.toml"
"""The configuration file's name in the home."""

ENVIRONMENT: Mapping[str, str] = {
    "backend": "SANDLOT_BACKEND",
    "database": "SANDLOT_DATABASE_URL",
    "policy": "SANDLOT_POLICY",
}
"""The settings an environment variable may give (``SANDLOT_POLICY`` is ``:``-separated)."""

DEFAULT = "default"


@final
@dataclass(frozen=True)
class Settings:
    """The effective settings of one process.

    ``values`` is the validated whole; ``sources`` names, for each dotted leaf
    (``server.port``, ``backends.local.pool.namespaces``), where its value came from:
    ``default``, the configuration file's path, ``env NAME`` or ``flag --name`` (or whatever
    label a caller gave its own overrides, such as an SDK argument).
    """

    home: Path
    values: SettingsModel
    sources: Mapping[str, str]
    config_file: Path | None
    """The file that was read (None: there was none)."""
    home_source: str = DEFAULT
    config_source: str = DEFAULT
    overrides: Mapping[str, object] = field(default_factory=dict)
    """What flags and arguments set, by dotted key (kept so a copy can be made with more)."""

    def source(self, key: str) -> str:
        """Where the dotted setting ``key`` came from."""
        return self.sources.get(key, DEFAULT)

    def effective(self) -> dict[str, tuple[object, str]]:
        """Every setting as ``dotted key -> (value, source)``, the home and file first."""
        rows: dict[str, tuple[object, str]] = {
            "home": (str(self.home), self.home_source),
            "config": (str(self.config_file) if self.config_file else None, self.config_source),
        }
        for key, value in _leaves(self.values.model_dump(mode="json")).items():
            rows[key] = (value, self.source(key))
        return rows


def load_settings(
    *,
    home: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, tuple[object, str]] | None = None,
    environ: Mapping[str, str] | None = None,
    home_source: str | None = None,
) -> Settings:
    """The effective settings: ``overrides`` > ``environ`` > the file > the defaults.

    Args:
        home: The state directory given explicitly (``--home``), else ``$SANDLOT_HOME``.
        config: The configuration file given explicitly (``--config``), else
            ``$SANDLOT_CONFIG``, else ``sandlot.toml`` in the home (which may be absent).
        overrides: Values given on the command line or as arguments, by dotted key, each
            with the label its source is shown as (``("8471", "flag --port")``). A None
            value is no override.
        environ: The environment (default ``os.environ``).
        home_source: Where an explicit ``home`` came from, when not a flag (the CLI's parser
            reads ``--home`` and ``$SANDLOT_HOME`` into one value).

    Raises:
        InvalidRequest: The file cannot be read or is not TOML, or a key is unknown, or a
            value has the wrong type; the message names the file (or variable, or flag) and
            the key.
    """
    env = os.environ if environ is None else environ
    if home is not None:
        home_source = home_source or "flag --home"
    elif env.get("SANDLOT_HOME"):
        home_source = "env SANDLOT_HOME"
    else:
        home_source = DEFAULT
    home_dir = resolve_home(home)
    if config is not None:
        path: Path | None = Path(config).expanduser().absolute()
        config_source, required = "flag --config", True
    elif env.get("SANDLOT_CONFIG"):
        path = Path(env["SANDLOT_CONFIG"]).expanduser().absolute()
        config_source, required = "env SANDLOT_CONFIG", True
    else:
        path, config_source, required = home_dir / CONFIG_FILE, DEFAULT, False

    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    assert path is not None
    table = _read(path, required)
    if table is None:
        path = None
    else:
        for key, value in _leaves(table).items():
            values[key] = _relative(key, value, path.parent)
            sources[key] = str(path)
    for key, var in ENVIRONMENT.items():
        raw = env.get(var)
        if raw:
            values[key] = raw.split(":") if key == "policy" else raw
            sources[key] = f"env {var}"
    given: dict[str, object] = {}
    for key, (value, label) in (overrides or {}).items():
        if value is not None:
            values[key] = value
            sources[key] = label
            given[key] = value
    model = _validate(values, sources)
    return Settings(
        home=home_dir,
        values=model,
        sources=sources,
        config_file=path,
        home_source=home_source,
        config_source=config_source,
        overrides=given,
    )


def _read(path: Path, required: bool) -> dict[str, object] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if not required:
            return None
        msg = f"{path}: no such configuration file"
        raise InvalidRequest(msg) from None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        msg = f"{path}: cannot read the configuration file ({why})"
        raise InvalidRequest(msg) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = f"{path}: not valid TOML: {e}"
        raise InvalidRequest(msg) from None


def _relative(key: str, value: object, base: Path) -> object:
    """Policy files named in the file are relative to the file, not to the working
    directory of whichever command reads it."""
    if key != "policy":
        return value
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        return value  # the schema says what is wrong with it
    return [str(base / Path(p).expanduser()) for p in paths]


def _leaves(table: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """A nested table as ``dotted key -> value`` (lists and scalars are leaves)."""
    flat: dict[str, object] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_leaves(value, name + "."))
        else:
            flat[name] = value
    return flat


def _nest(flat: Mapping[str, object], sources: Mapping[str, str]) -> dict[str, object]:
    nested: dict[str, object] = {}
    for key, value in flat.items():
        *tables, leaf = key.split(".")
        at = nested
        for i, part in enumerate(tables):
            inner = at.setdefault(part, {})
            if not isinstance(inner, dict):
                # ``server = 1`` in the file and ``server.port`` from a flag: the file's
                # value is what is wrong.
                where = ".".join(tables[: i + 1])
                raise InvalidRequest(
                    _message(sources.get(where, DEFAULT), where, "expected a table", inner)
                )
            at = inner
        at[leaf] = value
    return nested


def _validate(values: Mapping[str, object], sources: Mapping[str, str]) -> SettingsModel:
    try:
        return SettingsModel.model_validate(_nest(values, sources))
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
        key = ".".join(loc)
        # An error on a leaf is blamed on whoever gave that leaf; on a table (an unknown key
        # in it), on whoever gave the key.
        source = sources.get(key) or next(
            (s for k, s in sources.items() if k.startswith(key + ".")), DEFAULT
        )
        what = _expected(error, key)
        # An unknown key has no wrong value, and a validator's message names the value.
        shown = error["type"] not in ("extra_forbidden", "value_error")
        got = error.get("input") if shown else _UNSHOWN
        raise InvalidRequest(_message(source, key, what, got)) from None


_UNSHOWN = object()


def _message(source: str, key: str, what: str, got: object = _UNSHOWN) -> str:
    *tables, leaf = key.split(".")
    said = "" if got is _UNSHOWN else f", got {_shown(got)}"
    if source.startswith(("env ", "flag ", "argument ")):
        return f"{source.split(' ', 1)[1]}: {what}{said}"
    named = f"[{'.'.join(tables)}] {leaf}" if tables else leaf
    return f"{source}: {named}: {what}{said}"


def _shown(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


_EXPECTED = {
    "int": "expected an integer",
    "float": "expected a number",
    "bool": "expected true or false",
    "string": "expected a string",
    "tuple": "expected a list",
    "list": "expected a list",
    "model": "expected a table",
    "dict": "expected a table",
}


def _expected(error: Mapping[str, object], key: str) -> str:
    kind = str(error["type"])
    if kind == "extra_forbidden":
        return f"unknown key (known in this table: {_known(key)})"
    if kind in ("greater_than_equal", "less_than_equal", "literal_error", "value_error"):
        ctx = error.get("ctx")
        if kind == "value_error" and isinstance(ctx, Mapping):
            return str(ctx.get("error"))
        return str(error["msg"]).replace("Input should be", "expected a value").lower()
    for prefix, text in _EXPECTED.items():
        if kind.startswith(prefix):
            return text
    return str(error["msg"])


def _known(key: str) -> str:
    model: type[SettingsModel] | object = SettingsModel
    for part in key.split(".")[:-1]:
        fields = getattr(model, "model_fields", {})
        info = fields.get(part)
        if info is None:
            break
        model = info.annotation
    fields = getattr(model, "model_fields", {})
    return ", ".join(fields) or "none"
