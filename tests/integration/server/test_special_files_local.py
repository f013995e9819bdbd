"""Reading what is not a regular file through the file API, on a real ``local`` sandbox: a
clear 4xx naming the path, never a 502 as if the backend broke."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from sandlot.server.testing import ServerThread

pytestmark = [pytest.mark.needs_root, pytest.mark.slow]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "root (the local backend's namespaces, mounts and cgroups)"
    for tool, pkg in (("crun", "crun"), ("unshare", "util-linux"), ("mkfs.ext4", "e2fsprogs")):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {pkg})"
    return None


@pytest.mark.parametrize("isolation", ["namespaces", "gvisor"])
def test_special_files_are_refused_as_a_bad_request(tmp_path: Path, isolation: str) -> None:
    reason = _missing()
    if isolation == "gvisor" and shutil.which("runsc") is None:
        reason = "runsc (Debian package runsc)"
    if reason:
        pytest.skip(f"needs {reason}")
    spec = {"network": "deny-all", "backend_options": {"local": {"isolation": isolation}}}
    with ServerThread(tmp_path / "srv", backend="local") as server:
        key = server.new_key("files-tenant")
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as http:
            made = http.post("/v1/sandboxes", json={"spec": spec})
            assert made.status_code == 201, made.text
            sb = made.json()["id"]
            try:
                for path in ("/proc/self/mem", "/proc/1/mem", "/dev/tty"):
                    r = http.get(f"/v1/sandboxes/{sb}/files/content", params={"path": path})
                    assert r.status_code == 422, (path, r.status_code, r.text)
                    problem = r.json()
                    assert problem["code"] == "invalid_request", (path, problem)
                    # The file API reads the path as resolved inside the sandbox: /proc/self
                    # is the agent's own /proc/<pid>.
                    assert re.search(r"^/(proc/\d+|dev)/(mem|tty)\b", problem["detail"]), problem
                    assert path.rsplit("/", 1)[1] in problem["detail"], problem
                    assert "cannot be read" in problem["detail"], problem
                # The sandbox is fine afterwards: a regular file still reads.
                r = http.get(f"/v1/sandboxes/{sb}/files/content", params={"path": "/etc/hostname"})
                assert r.status_code == 200, r.text
            finally:
                http.delete(f"/v1/sandboxes/{sb}")
