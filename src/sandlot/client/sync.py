"""The sync HTTP client: :class:`Client`, a thin facade over :mod:`sandlot.client.remote`.

    with Client("http://127.0.0.1:8470", api_key) as client:
        with client.create() as sb:
            print(sb.exec("echo hi").stdout)

Every method but the constructor comes from :class:`sandlot.facade.SyncClientBase`, and its
sandboxes are :class:`sandlot.Sandbox` handles around the client's async ones: the sync surface
is written once for the in-process SDK and the client, and runs each call's async twin on an
event loop in a background thread. A test checks the surfaces match name for name and
signature for signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import httpx

from sandlot.client.remote import AsyncClient
from sandlot.facade import SyncClientBase
from sandlot.models import Approval
from sandlot.shared import EventLoopThread

__all__ = ["Client"]


@final
class Client(SyncClientBase[AsyncClient]):
    """The sync SDK against a sandlot server; arguments as for :class:`AsyncClient`."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        reconnect_timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        on_hold: Callable[[Approval], object] | None = None,
    ) -> None:
        self._loop = EventLoopThread()
        try:
            self._async = self._loop.run(
                _build(url, api_key, timeout, reconnect_timeout, transport, on_hold)
            )
        except BaseException:
            self._loop.close()
            raise

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._async.url

    def __repr__(self) -> str:
        return f"<Client {self.url}>"


async def _build(
    url: str | None,
    api_key: str | None,
    timeout: float,
    reconnect_timeout: float,
    transport: httpx.AsyncBaseTransport | None,
    on_hold: Callable[[Approval], object] | None,
) -> AsyncClient:
    # Built on the loop thread, so the connection pool belongs to that loop.
    return AsyncClient(
        url,
        api_key,
        timeout=timeout,
        reconnect_timeout=reconnect_timeout,
        transport=transport,
        on_hold=on_hold,
    )
