"""The object store port: where media bytes live (never PostgreSQL, never the bus).

This module imports no storage driver. Adapters implement :class:`ObjectStore`, raise only the
errors below (driver errors are translated at the adapter edge) and pass
``tests/contract/object_store_contract.py``.

Semantics every adapter keeps:

* **Whole objects.** ``put`` either stores the complete object under ``key`` or nothing: a reader
  never sees a half-written object, and a ``put`` whose data source fails leaves the previous
  object (or no object) in place.
* **Last writer wins.** ``put`` on an existing key replaces it.
* **Keys** are ``/``-separated segments of ``[A-Za-z0-9._-]``, no segment ``.`` or ``..``, at most
  512 characters (see :func:`validate_key`); invalid keys raise ``ValueError``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from aivedio.errors import AivedioError

__all__ = ["ObjectInfo", "ObjectNotFound", "ObjectStore", "StorageError", "validate_key"]


class StorageError(AivedioError):
    """Root of every object store error; an I/O failure of the backend. Retrying may help."""


class ObjectNotFound(StorageError):
    """No object under that key."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    content_type: str


class ObjectStore(Protocol):
    async def put(
        self, key: str, data: bytes | AsyncIterable[bytes], content_type: str
    ) -> ObjectInfo:
        """Store the whole object (atomically replacing an existing one); return its info."""
        ...

    async def stat(self, key: str) -> ObjectInfo | None:
        """The object's info, or ``None`` when there is none."""
        ...

    async def exists(self, key: str) -> bool: ...

    def read(
        self, key: str, *, offset: int = 0, length: int | None = None, chunk_size: int = 65536
    ) -> AsyncIterator[bytes]:
        """The object's bytes from ``offset`` (``length`` of them, or to the end), in chunks.
        Raises ``ObjectNotFound`` when iteration starts and the object does not exist."""
        ...

    async def delete(self, key: str) -> bool:
        """Remove the object; ``True`` if there was one."""
        ...


_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")


def validate_key(key: str) -> str:
    if not key or len(key) > 512 or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid object key {key!r}")
    for segment in key.split("/"):
        if segment in (".", "..") or not _SEGMENT.fullmatch(segment):
            raise ValueError(f"invalid object key {key!r}: segments of [A-Za-z0-9._-]")
    return key
