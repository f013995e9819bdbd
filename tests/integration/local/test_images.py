"""Image root filesystems: a directory, a tarball or an OCI layout, unpacked once and shared."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.errors import BackendError, InvalidRequest
from sandlot.models import ExecResult, new_id

BUSYBOX = shutil.which("busybox")
pytestmark = pytest.mark.skipif(
    BUSYBOX is None, reason="needs busybox (Debian package busybox-static)"
)


async def sh(backend: LocalBackend, ref: str, script: str) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(["sh", "-c", script], timeout=60)
    finally:
        await channel.close()


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    """A busybox root filesystem with no Python in it."""
    root = tmp_path / "rootfs"
    for d in ("bin", "etc", "tmp", "root"):
        (root / d).mkdir(parents=True)
    assert BUSYBOX is not None
    shutil.copy(BUSYBOX, root / "bin" / "busybox")
    for applet in ("sh", "cat", "echo", "ls", "id", "env", "sleep", "wc"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "image-release").write_text("busybox-image\n")
    return root


def _tarball(rootfs: Path, dest: Path, compress: str | None) -> Path:
    argv = ["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(dest), "."]
    if compress:
        if shutil.which(compress) is None:
            pytest.skip(f"needs {compress} (Debian package {compress})")
        argv.insert(1, f"--{compress}")
    subprocess.run(argv, check=True)
    return dest


def _oci_layout(rootfs: Path, tmp_path: Path) -> str:
    if shutil.which("umoci") is None:
        pytest.skip("needs umoci (Debian package umoci)")
    layout = tmp_path / "oci"
    bundle = tmp_path / "oci-bundle"

    def umoci(*args: str) -> None:
        subprocess.run(["umoci", *args], check=True, capture_output=True)

    umoci("init", "--layout", str(layout))
    umoci("new", "--image", f"{layout}:v1")
    umoci("unpack", "--image", f"{layout}:v1", str(bundle))
    shutil.rmtree(bundle / "rootfs")
    shutil.copytree(rootfs, bundle / "rootfs", symlinks=True)
    umoci("repack", "--image", f"{layout}:v1", str(bundle))
    umoci("config", "--image", f"{layout}:v1", "--config.env", "IMAGE_VAR=from-config")
    return f"oci:{layout}:v1"


@pytest.mark.parametrize("kind", ["dir", "tar", "tar.gz", "tar.zst", "oci"])
async def test_image_root(backend, isolation, spec_for, rootfs, tmp_path, kind) -> None:
    if kind == "dir":
        image = str(rootfs)
    elif kind == "oci":
        image = _oci_layout(rootfs, tmp_path)
    else:
        compress = {"tar": None, "tar.gz": "gzip", "tar.zst": "zstd"}[kind]
        image = str(_tarball(rootfs, tmp_path / f"image.{kind}", compress))
    spec = spec_for(isolation, image=image)
    ref = await backend.create(new_id("sb"), spec)
    cached = layer_count(backend)
    result = await sh(backend, ref, "cat /etc/image-release; id -u; echo $IMAGE_VAR; ls /usr 2>&1")
    lines = result.stdout.splitlines()
    assert lines[:2] == ["busybox-image", "0"]
    if kind == "oci":
        assert lines[2] == "from-config"
    # No host /usr in an image: only the agent's private copy of the host interpreter.
    assert "No such file" in result.stdout
    await sh(backend, ref, "echo changed > /etc/image-release")
    # A second sandbox from the same image shares the unpacked layer, not the first's changes.
    other = await backend.create(new_id("sb"), spec)
    assert (await sh(backend, other, "cat /etc/image-release")).stdout == "busybox-image\n"
    assert layer_count(backend) == cached
    if kind == "dir":
        # The source may change later without touching sandboxes made from it.
        (rootfs / "etc" / "image-release").write_text("edited source\n")
        third = await backend.create(new_id("sb"), spec)
        assert (await sh(backend, third, "cat /etc/image-release")).stdout == "edited source\n"
        assert (await sh(backend, other, "cat /etc/image-release")).stdout == "busybox-image\n"


def layer_count(backend: LocalBackend) -> int:
    return sum(p.is_dir() for p in (backend.rootfs_cache_dir / "images").iterdir())


async def test_bad_image_references_are_refused(backend, spec_for, tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    for image, match in (
        ("relative/path", "absolute"),
        (str(tmp_path / "missing"), "does not exist"),
        (str(tmp_path / "notes.txt"), "not a tarball"),
        (f"oci:{tmp_path}:v1", "not an OCI image index"),
    ):
        with pytest.raises(InvalidRequest, match=match):
            await backend.create(new_id("sb"), spec_for("namespaces", image=image))
    assert await backend.list_owned() == {}


async def test_a_vanished_layer_fails_the_boot_with_a_backend_error(
    backend, spec_for, rootfs
) -> None:
    # Steps of a boot run side by side; their failures still reach the caller as themselves.
    (rootfs / "etc" / "unique").write_text(new_id("layer"))
    spec = spec_for("namespaces", image=str(rootfs))
    ref = await backend.create(new_id("sb"), spec)
    await backend.stop(ref)
    meta = json.loads((backend.state_dir / ref / "meta.json").read_text())
    shutil.rmtree(meta["layers"][0]["path"])
    with pytest.raises(BackendError, match="is gone"):
        await backend.start(ref, spec)
    await backend.destroy(ref)
    assert await backend.list_owned() == {}
