"""Test helpers for sandlot users: the in-memory ``fake`` backend.

from sandlot import Sandlot
from sandlot.testing import FakeBackend, FakeExec
from sandlot.models import ExecResult

def answer(req: FakeExec) -> ExecResult | None:
    if req.argv[:1] == ["pytest"]:
        return ExecResult(exit_code=0, stdout="1 passed\n")
    return None  # fall back to the fake's built-ins

fake = FakeBackend(exec_handler=answer)
with Sandlot(home=tmp_path, backends={"fake": fake}) as client:
    ...
assert fake.calls_for(sb.id, "exec")
"""

from sandlot.backends.fake import FakeBackend, FakeCall, FakeChannel, FakeExec, FakeSandbox

__all__ = ["FakeBackend", "FakeCall", "FakeChannel", "FakeExec", "FakeSandbox"]
