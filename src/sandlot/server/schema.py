"""The API key table, registered on the shared :data:`sandlot.store.schema.metadata`.

A key is stored only as the SHA-256 of its text: the key is 256 random bits, so a plain hash
is as strong as a slow password hash would be, and it keeps authentication to one indexed
lookup. Keys are never deleted, only revoked, so ``list`` keeps showing who had access. This
module imports only SQLAlchemy and the store's metadata.
"""

from __future__ import annotations

from sqlalchemy import Boolean, Column, Float, Index, String, Table

from sandlot.store.schema import metadata

__all__ = ["api_keys"]

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("key_hash", String(64), nullable=False),
    Column("prefix", String(24), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("principal", String(256), nullable=False),
    Column("admin", Boolean, nullable=False),
    Column("description", String(512)),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float),
    Index("ux_api_keys_key_hash", "key_hash", unique=True),
    Index("ix_api_keys_tenant", "tenant"),
)
