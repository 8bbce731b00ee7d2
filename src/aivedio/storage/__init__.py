"""The object store port and its adapters (``filesystem.py``; an S3 adapter would be one more)."""

from aivedio.storage.port import (
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    validate_key,
)

__all__ = ["ObjectInfo", "ObjectNotFound", "ObjectStore", "StorageError", "validate_key"]
