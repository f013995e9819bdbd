"""The options each backend takes in ``SandboxSpec.backend_options``, declared in one place.

A spec may carry options for several backends, so that the same spec runs on any of them; each
backend reads only its own entry. An entry for a backend this build does not know, a key its
backend does not declare, or a value outside the declared choices is a mistake the user must
hear about, not an option silently ignored: :func:`check_backend_options` refuses each one
naming what is known. This module imports no backend (the registry and the backends import it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import final

from sandlot.errors import InvalidRequest

__all__ = ["BACKEND_OPTIONS", "BackendOption", "check_backend_options"]


@final
@dataclass(frozen=True)
class BackendOption:
    """One key a backend reads from its ``backend_options`` entry."""

    help: str
    """What it selects, for error messages and documentation."""
    choices: tuple[str, ...] | None = None
    """The values it takes, when it is one of a few names."""


BACKEND_OPTIONS: Mapping[str, Mapping[str, BackendOption]] = {
    "fake": {},
    "local": {
        "isolation": BackendOption(
            "the OCI runtime: namespaces (crun) or gvisor (runsc, a user-space kernel)",
            ("namespaces", "gvisor"),
        ),
        "enforcement": BackendOption(
            "standard, or strict: every execve in the sandbox stops in the kernel and is "
            "decided by the policy gate (crun as root only)",
            ("standard", "strict"),
        ),
        "protected_paths": BackendOption(
            "paths made read-only inside the sandbox by the kernel (a list; see "
            "sandlot.backends.local.protect)"
        ),
        "hidden_paths": BackendOption(
            "paths made absent (empty) inside the sandbox by the kernel (a list)"
        ),
    },
    "microvm": {},
}
"""Every backend this build knows, and the options it takes (a test checks the names match
the registry's)."""


def check_backend_options(
    options: Mapping[str, Mapping[str, object]], *, flag: str | None = None
) -> None:
    """Refuse an unknown backend, an undeclared key, or a value outside its choices.

    Args:
        options: ``backend_options`` as in a spec (backend name -> key -> value).
        flag: The command-line option the entries came from (``--option``), to name them the
            way the user wrote them; by default they are named as spec fields.

    Raises:
        InvalidRequest: The first entry that names nothing a backend reads.
    """
    for backend, entry in options.items():
        declared = BACKEND_OPTIONS.get(backend)
        where = f"{flag} {backend}" if flag else f"backend_options.{backend}"
        if declared is None:
            named = f"{where}.{next(iter(entry))}" if flag and entry else where
            msg = f"{named}: unknown backend {backend!r} (known: {', '.join(BACKEND_OPTIONS)})"
            raise InvalidRequest(msg)
        for key, value in entry.items():
            name = f"{where}.{key}"
            option = declared.get(key)
            if option is None:
                takes = (
                    f"its options: {', '.join(sorted(declared))}"
                    if declared
                    else "it takes no options"
                )
                msg = f"{name}: the {backend} backend has no option {key!r} ({takes})"
                raise InvalidRequest(msg)
            if option.choices is not None and value not in option.choices:
                msg = f"{name} must be one of {', '.join(option.choices)}, got {value!r}"
                raise InvalidRequest(msg)
