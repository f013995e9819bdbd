"""API-key checks answer while the server's shared worker-thread pool is full."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import anyio.to_thread

from sandlot.server.keys import ApiKeyStore


async def test_authentication_does_not_wait_for_a_full_thread_pool(tmp_path: Path) -> None:
    store = ApiKeyStore(f"sqlite:///{tmp_path / 'keys.db'}")
    try:
        key = (await store.create("tenant-a")).key
        pool = anyio.to_thread.current_default_thread_limiter()
        release = threading.Event()
        async with anyio.create_task_group() as tg:
            # Other work (a slow backend or database call per request) holds every token.
            for _ in range(int(pool.total_tokens)):
                tg.start_soon(anyio.to_thread.run_sync, release.wait)
            try:
                with anyio.fail_after(10):
                    while pool.borrowed_tokens < pool.total_tokens:
                        await anyio.sleep(0.01)
                with anyio.fail_after(5):
                    actor = await store.authenticate(key)
            finally:
                release.set()
        assert actor is not None
        assert actor.tenant == "tenant-a"
    finally:
        await store.aclose()
