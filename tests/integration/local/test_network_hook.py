"""The network hook: with the network service plugged in, sandboxes join a prepared namespace."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from sandlot.errors import NotSupported
from sandlot.models import SandboxSpec, new_id

pytestmark = pytest.mark.skipif(
    shutil.which("ip") is None or shutil.which("nft") is None,
    reason="needs ip and nft (Debian packages iproute2, nftables)",
)


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.fixture
def networked(make_backend, tmp_path):
    from sandlot.network.service import SandboxNetworks

    networks = SandboxNetworks(tmp_path / "network-state")
    if not networks.capabilities():
        pytest.skip("the network service cannot run here")
    return make_backend(networks=networks)


async def test_sandboxes_join_the_prepared_namespace(networked) -> None:
    assert {"allow-all", "deny-all"} <= networked.capabilities().network
    before = netns_names()
    ref = await networked.create(new_id("sb"), SandboxSpec())
    channel = await networked.channel(ref)
    devices = (await channel.exec(["cat", "/proc/net/dev"])).stdout
    await channel.close()
    assert "eth0:" in devices
    # Other suites may make and remove namespaces meanwhile: only this sandbox's one counts.
    mine = netns_names() - before
    assert mine
    await networked.destroy(ref)
    assert not mine & netns_names()


async def test_gvisor_is_deny_all_only(networked) -> None:
    spec = SandboxSpec(backend_options={"local": {"isolation": "gvisor"}})
    with pytest.raises(NotSupported, match="gvisor"):
        await networked.create(new_id("sb"), spec)
