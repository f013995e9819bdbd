"""Eight processes race to use one stopped sandbox: exactly one resume reaches the backend.

Each process runs its own Manager (the SDK) on the shared database; the backend is the fake,
keeping its sandboxes in a file and logging every call it receives to another file, so what
reached "the backend" is visible across processes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio

from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend

RACER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from pathlib import Path
    from sandlot.sdk import AsyncSandlot
    from sandlot.testing import FakeBackend

    home, db, state, calls, sid, go = sys.argv[1:7]

    class Logged(FakeBackend):
        async def start(self, ref, spec):
            with open(calls, "a") as f:
                f.write(f"start {os.getpid()}\\n")
            await super().start(ref, spec)

    async def main():
        async with AsyncSandlot(home, database=db, backends={"fake": Logged(state_file=Path(state))}) as c:
            sb = await c.get(sid)
            Path(go + f".ready{os.getpid()}").touch()
            while not Path(go).exists():
                time.sleep(0.001)
            print((await sb.exec(["echo", "hi"])).stdout.strip())

    asyncio.run(main())
    """
)


async def test_eight_processes_resume_once(db_url: str, tmp_path: Path) -> None:
    home, state, calls, go = (
        tmp_path / "home",
        tmp_path / "fake.json",
        tmp_path / "calls",
        tmp_path / "go",
    )
    async with AsyncSandlot(
        home, database=db_url, backends={"fake": FakeBackend(state_file=state)}
    ) as client:
        sb = await client.create()
        await sb.stop()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RACER,
                str(home),
                db_url,
                str(state),
                str(calls),
                sb.id,
                str(go),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("go.ready*"))) < 8 and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        await anyio.sleep(0.02)
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert out.strip() == "hi"
    assert len(calls.read_text().splitlines()) == 1, calls.read_text()
    async with AsyncSandlot(
        home, database=db_url, backends={"fake": FakeBackend(state_file=state)}
    ) as client:
        assert (await client.get(sb.id)).status.value == "running"
