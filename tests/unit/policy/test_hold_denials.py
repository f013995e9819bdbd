"""A HOLD that ends in a denial says which rule held it and how it could have run."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandlot import PolicyDenied
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend

HOLD_EXEC = (
    'permit (principal, action, resource) unless { action == Action::"exec" };\n'
    '@id("hold-exec")\n@hold("may this agent run it?")\n'
    'permit (principal, action == Action::"exec", resource);\n'
)


async def test_a_hold_that_times_out_names_the_rule_and_what_to_do(
    home: Path, tmp_path: Path
) -> None:
    policy = tmp_path / "hold.cedar"
    policy.write_text(HOLD_EXEC)
    fake = FakeBackend()
    async with AsyncSandlot(
        home, backends={"fake": fake}, policy=policy, hold_timeout=0.2
    ) as client:
        sb = await client.create()
        with pytest.raises(PolicyDenied) as info:
            await sb.exec(["echo", "late"])
    assert info.value.reason_code == "HOLD_TIMEOUT"
    assert info.value.message == (
        "exec held for approval by hold-exec got no answer within 0.2s (may this agent run "
        "it?); to run it, ask again and have it approved in time (sandlot approvals approve ID)"
    )
    assert fake.calls_for(sb.id, "exec") == []
