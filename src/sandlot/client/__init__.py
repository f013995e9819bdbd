"""The client SDK for a sandlot server: the same surface as the in-process SDK, over HTTP.

    from sandlot.client import Client

    with Client("http://127.0.0.1:8470", api_key="sandlot_…") as client:
        with client.create(setup="echo ready") as sb:
            print(sb.exec("uname -a").stdout)

:class:`AsyncClient` / :class:`Client` mirror :class:`sandlot.AsyncSandlot` /
:class:`sandlot.Sandlot` (both implement :class:`sandlot.api.SandlotAPI`); their sandboxes are
the SDK's own handles, :class:`sandlot.AsyncSandbox` (also named :data:`AsyncRemoteSandbox`
here) and :class:`sandlot.Sandbox`; errors are the same classes. Importing this package loads
no server, Manager, store, policy engine, SQLAlchemy or cryptography (a test and an
import-linter contract check it). This module only re-exports.
"""

from __future__ import annotations

from sandlot.client.remote import AsyncClient, AsyncRemoteSandbox
from sandlot.client.sync import Client

__all__ = ["AsyncClient", "AsyncRemoteSandbox", "Client"]
