"""Protected and hidden paths as they reach the OCI config: normalized, deduplicated, refused
where the runtime owns the path or the value is not a list of absolute paths. (That the kernel
then holds them is tests/security/test_protected_paths.py, which needs root and crun.)"""

from __future__ import annotations

import pytest

from sandlot.backends.local import protect
from sandlot.errors import InvalidRequest, NotSupported
from sandlot.models import SandboxSpec


def _spec(**local: object) -> SandboxSpec:
    return SandboxSpec(backend_options={"local": local})


def test_paths_are_normalized_and_added_to_the_config() -> None:
    spec = _spec(protected_paths=["/etc/", "//usr//local", "/etc"], hidden_paths=["/srv/x"])
    assert protect.paths(spec, "protected_paths") == ("/etc", "/usr/local")
    doc: dict[str, object] = {"linux": {"readonlyPaths": ["/proc/sys"], "maskedPaths": []}}
    protect.apply(doc, spec)
    assert doc["linux"] == {
        "readonlyPaths": ["/proc/sys", "/etc", "/usr/local"],
        "maskedPaths": ["/srv/x"],
    }


def test_no_option_changes_nothing() -> None:
    doc: dict[str, object] = {"linux": {"readonlyPaths": ["/proc/sys"]}}
    protect.apply(doc, _spec())
    assert doc == {"linux": {"readonlyPaths": ["/proc/sys"]}}


@pytest.mark.parametrize(
    "value",
    ["/etc", ["etc"], ["/etc/../root"], ["/"], ["/proc"], ["/proc/sys"], ["/dev/shm"], [1]],
    ids=str,
)
def test_what_cannot_be_protected_is_refused(value: object) -> None:
    with pytest.raises(InvalidRequest, match=r"backend_options\.local\.hidden_paths"):
        protect.check(_spec(hidden_paths=value))


def test_gvisor_refuses_them() -> None:
    with pytest.raises(NotSupported, match="protected_paths"):
        protect.check(_spec(isolation="gvisor", protected_paths=["/etc"]))
    protect.check(_spec(isolation="gvisor", protected_paths=[]))
