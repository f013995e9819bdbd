"""What ``sandlot.toml`` may say: one pydantic model per table, every key with its default.

The models are the single description of every setting: the file is validated against them,
the defaults are read from them, and ``sandlot config show`` lists their leaves. Each model
forbids keys it does not declare, so a misspelt key is an error rather than a setting silently
ignored. This module imports pydantic and the backend option table only (it is loaded when a
command needs its settings, so it must stay light: no store, Manager or backend).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandlot.backends.options import BACKEND_OPTIONS

__all__ = [
    "BackendsSection",
    "LocalPool",
    "LocalSection",
    "MicrovmSection",
    "ServerSection",
    "SettingsModel",
]

Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(ge=0)]


class _Table(BaseModel):
    # strict: a TOML string "8470" is not a port, and true is not 1.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class LocalPool(_Table):
    """``[backends.local.pool]``: booted sandboxes kept ready per isolation."""

    namespaces: Count = 0
    gvisor: Count = 0


class LocalSection(_Table):
    """``[backends.local]``."""

    isolation: Literal["namespaces", "gvisor"] = "namespaces"
    """The isolation of a new sandbox whose spec does not choose one."""
    pool: LocalPool = LocalPool()


class MicrovmSection(_Table):
    """``[backends.microvm]``."""

    pool: Count = 0
    """Restored, warmed-up VMs kept ready per machine configuration."""


class BackendsSection(_Table):
    """``[backends]``: each backend's own table."""

    local: LocalSection = LocalSection()
    microvm: MicrovmSection = MicrovmSection()


class ServerSection(_Table):
    """``[server]``: what ``sandlot serve`` listens on and how much each tenant may use."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8470
    max_sandboxes: Positive | None = None
    max_execs: Positive | None = None
    max_uploads: Positive = 4
    max_uploads_total: Positive = 16
    admission_timeout: Seconds = 30.0
    max_upload_mb: Positive = 256
    max_download_mb: Positive = 1024
    output_retention: Seconds = 300.0
    output_max_mb: Annotated[float, Field(ge=0.001)] = 4.0
    public_metrics: bool = False
    public_docs: bool = False
    mcp: bool = True
    enable_backends: tuple[str, ...] = ()

    @field_validator("admission_timeout", "output_retention", "output_max_mb", mode="before")
    @classmethod
    def _int_is_a_number(cls, value: object) -> object:
        # TOML writes 30 and 30.0 differently; both are a number of seconds.
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("enable_backends", mode="before")
    @classmethod
    def _list_is_a_tuple(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value


class SettingsModel(_Table):
    """The whole file (and every effective setting)."""

    backend: str | None = None
    """The backend for new sandboxes (None: ``local``, or ``fake`` where there is none)."""
    database: str | None = None
    """A database URL or SQLite file (None: ``sandlot.db`` in the home)."""
    policy: tuple[str, ...] = ()
    """Cedar policy files (empty: the shipped default policy)."""
    backends: BackendsSection = BackendsSection()
    server: ServerSection = ServerSection()

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        if value is not None and value not in BACKEND_OPTIONS:
            msg = f"unknown backend {value!r}; known backends: {', '.join(BACKEND_OPTIONS)}"
            raise ValueError(msg)
        return value

    @field_validator("policy", mode="before")
    @classmethod
    def _one_or_more(cls, value: object) -> object:
        if isinstance(value, str):
            return (value,)
        return tuple(value) if isinstance(value, list) else value
