"""The MCP server: sandlot's tools for models (``sandlot mcp`` on stdio, ``/mcp`` over HTTP).

This module only re-exports.
"""

from __future__ import annotations

from sandlot.mcp.server import ApiProvider, SandboxHandle, SandlotApi, build_server

__all__ = ["ApiProvider", "SandboxHandle", "SandlotApi", "build_server"]
