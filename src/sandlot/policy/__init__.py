"""sandlot.policy: the gate's decision half — normalization, engines, decisions.

``normalize_operation(...)`` turns an operation into a :class:`PolicyRequest`;
``load_engine(config)`` builds the configured :class:`PolicyEngine`; ``engine.decide(request)``
returns a :class:`Decision` and ``engine.explain(request)`` an :class:`Explanation`.
Re-exports only.
"""

from sandlot.policy.engine import (
    Decision,
    Explanation,
    Outcome,
    PolicyEngine,
    PolicyTrace,
    ReasonCode,
    UnitTrace,
)
from sandlot.policy.factory import PolicyConfig, load_engine
from sandlot.policy.normalize import normalize_command, normalize_operation, normalize_path
from sandlot.policy.request import ACTIONS, ActionInfo, PolicyRequest, Principal, Resource

__all__ = [
    "ACTIONS",
    "ActionInfo",
    "Decision",
    "Explanation",
    "Outcome",
    "PolicyConfig",
    "PolicyEngine",
    "PolicyRequest",
    "PolicyTrace",
    "Principal",
    "ReasonCode",
    "Resource",
    "UnitTrace",
    "load_engine",
    "normalize_command",
    "normalize_operation",
    "normalize_path",
]
