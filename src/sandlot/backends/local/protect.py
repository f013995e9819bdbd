"""Paths enforced by the kernel: what a sandbox's spec protects is read-only (or absent) inside.

A policy decides on the path a request names; a symlink planted inside the sandbox, a script or
an interpreter can carry a write somewhere the request does not say. The kernel cannot be
talked around: ``backend_options.local.protected_paths`` lists paths made read-only inside
the sandbox (every write under them fails with ``EROFS``, however it is spelled), and
``hidden_paths`` paths made absent (an empty read-only directory in their place; a file is
covered by ``/dev/null``, which reads empty and discards writes). Both go into the OCI ``linux.readonlyPaths`` and ``linux.maskedPaths``: the runtime
resolves each inside the sandbox's root at every start (a symlink in the sandbox resolves
inside it, never to the host) and bind-mounts it onto itself read-only, or masks it.

A path that does not exist when the sandbox starts is skipped by the runtime, so it is not
protected until the next start: name paths that exist in the image (``/etc``, a checked-out
directory), not ones an agent might create.

This module imports only the models and the errors.
"""

from __future__ import annotations

import posixpath

from sandlot.errors import InvalidRequest, NotSupported
from sandlot.models import SandboxSpec

__all__ = ["OPTIONS", "apply", "check", "paths"]

OPTIONS = ("protected_paths", "hidden_paths")
"""The ``backend_options.local`` keys this module reads."""

# The runtime mounts these itself (or the sandbox depends on them being writable); a bind of
# one onto itself would hide what the runtime put there.
_REFUSED = ("/", "/proc", "/sys", "/dev", "/.sandlot")


def paths(spec: SandboxSpec, option: str) -> tuple[str, ...]:
    """The normalized paths of ``option`` (one of :data:`OPTIONS`) in ``spec``.

    Raises:
        InvalidRequest: Not a list of absolute paths, or a path the runtime owns.
    """
    value = spec.options_for("local").get(option)
    if value is None:
        return ()
    where = f"backend_options.local.{option}"
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        msg = f"{where} must be a list of absolute paths, got {value!r}"
        raise InvalidRequest(msg)
    out: list[str] = []
    for raw in value:
        assert isinstance(raw, str)
        path = posixpath.normpath(raw)
        if not raw.startswith("/") or "\0" in raw or ".." in raw.split("/"):
            msg = f"{where}: {raw!r} must be an absolute path without '..'"
            raise InvalidRequest(msg)
        if path.startswith("//"):  # normpath keeps a leading '//'
            path = "/" + path.lstrip("/")
        if any(path == r or path.startswith(f"{r}/") for r in _REFUSED if r != "/") or path == "/":
            msg = f"{where}: {raw!r} is mounted by the runtime itself and cannot be protected"
            raise InvalidRequest(msg)
        if path not in out:
            out.append(path)
    return tuple(out)


def check(spec: SandboxSpec) -> None:
    """Refuse protected or hidden paths the runtime could not enforce.

    Raises:
        InvalidRequest: A malformed list (see :func:`paths`).
        NotSupported: Under gVisor (runsc), which was measured to answer ``EINVAL`` for the
            paths instead of making them read-only.
    """
    named = [option for option in OPTIONS if paths(spec, option)]
    if named and spec.options_for("local").get("isolation") == "gvisor":
        msg = f"backend_options.local.{named[0]} needs isolation='namespaces' (crun)"
        raise NotSupported(msg)


def apply(doc: dict[str, object], spec: SandboxSpec) -> None:
    """Add the spec's protected and hidden paths to an OCI ``config.json`` document."""
    linux = doc.setdefault("linux", {})
    assert isinstance(linux, dict)
    for option, key in (("protected_paths", "readonlyPaths"), ("hidden_paths", "maskedPaths")):
        extra = paths(spec, option)
        if extra:
            current = linux.setdefault(key, [])
            assert isinstance(current, list)
            current.extend(p for p in extra if p not in current)
