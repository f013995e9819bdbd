"""Choosing and building the policy engine from configuration.

:func:`load_engine` is what the Manager calls: Cedar with the shipped default policy unless the
configuration says otherwise. Engines are imported only when chosen, so an install without
cedarpy can still run the builtin engine. This module imports the policy package and
:mod:`sandlot.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, final

from pydantic import BaseModel, ConfigDict, Field

from sandlot.errors import InvalidRequest, NotSupported
from sandlot.models import parse_model
from sandlot.policy.engine import PolicyEngine

__all__ = ["PolicyConfig", "load_engine"]


@final
class PolicyConfig(BaseModel):
    """How the gate decides."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    engine: Literal["cedar", "builtin", "opa"] = "cedar"
    """``cedar`` (default), ``builtin`` (no dependency) or ``opa`` (a remote decision point)."""
    policy_paths: tuple[str, ...] = ()
    """Cedar: policy files, concatenated (``"default"`` is the shipped policy; empty means only
    it). Builtin: one rules file (``.toml`` or ``.json``; empty means the shipped rules)."""
    schema_path: str | None = None
    """Cedar: a custom schema file (default: sandlot's)."""
    validate_policies: bool = True
    """Cedar: check policies against the schema when loading."""
    url: str | None = None
    """OPA: the server's base URL."""
    path: str = "sandlot/decision"
    """OPA: the rule's path under ``/v1/data/``."""
    timeout: float = Field(default=0.5, gt=0)
    """OPA: seconds before an unanswered decision is a DENY."""
    on_error: Literal["deny", "allow"] = "deny"
    """When the engine cannot decide: deny (default), or allow with ``POLICY_ERROR_FAIL_OPEN``."""


def load_engine(config: PolicyConfig | Mapping[str, object] | None = None) -> PolicyEngine:
    """Build the configured policy engine.

    Args:
        config: A :class:`PolicyConfig`, its dict form, or None for the defaults (Cedar with
            the shipped policy, fail closed).

    Returns:
        A ready engine; policies are parsed and validated now, not at the first decision.

    Raises:
        InvalidRequest: bad configuration or invalid policies.
        NotSupported: ``engine = "cedar"`` without the cedarpy package installed.
    """
    if config is None:
        config = PolicyConfig()
    elif not isinstance(config, PolicyConfig):
        config = parse_model(PolicyConfig, dict(config))
    if config.engine == "cedar":
        try:
            from sandlot.policy.cedar import CedarEngine
        except ImportError as e:
            msg = f"the cedar policy engine needs the cedarpy package ({e}); install it or set engine = 'builtin'"
            raise NotSupported(msg) from None
        return CedarEngine.from_files(
            config.policy_paths or ("default",),
            schema_path=config.schema_path,
            on_error=config.on_error,
            validate=config.validate_policies,
        )
    if config.engine == "builtin":
        from sandlot.policy.builtin import BuiltinEngine

        if len(config.policy_paths) > 1:
            msg = "the builtin engine takes one rules file"
            raise InvalidRequest(msg)
        return BuiltinEngine.from_file(
            config.policy_paths[0] if config.policy_paths else "default", on_error=config.on_error
        )
    from sandlot.policy.opa import OpaEngine

    if not config.url:
        msg = "the opa policy engine needs a url"
        raise InvalidRequest(msg)
    return OpaEngine(config.url, config.path, timeout=config.timeout, on_error=config.on_error)
