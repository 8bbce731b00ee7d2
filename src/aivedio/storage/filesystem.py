"""The filesystem adapter of the object store: one directory tree under a configured root.

Layout: ``<root>/data/<key>`` holds the bytes and ``<root>/meta/<key>.json`` the content type.
A put writes both to temporary files in the target directories, then renames the metadata and
finally the data into place (``os.replace`` is atomic on one filesystem), so an object exists
exactly when its data file does and is never seen half-written. File I/O runs in worker threads.

Good for one machine or a shared POSIX volume; a multi-host deployment uses an S3-style adapter
behind the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from aivedio.storage.port import ObjectInfo, ObjectNotFound, StorageError, validate_key

__all__ = ["FileSystemObjectStore", "FileSystemStoreConfig"]

_DEFAULT_TYPE = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class FileSystemStoreConfig:
    root: Path


class FileSystemObjectStore:
    def __init__(self, config: FileSystemStoreConfig) -> None:
        self.root = config.root
        self._data = config.root / "data"
        self._meta = config.root / "meta"

    def _paths(self, key: str) -> tuple[Path, Path]:
        validate_key(key)
        return self._data / key, self._meta / f"{key}.json"

    async def put(
        self, key: str, data: bytes | AsyncIterable[bytes], content_type: str
    ) -> ObjectInfo:
        data_path, meta_path = self._paths(key)
        tag = uuid.uuid4().hex
        tmp_data = data_path.with_name(f".{data_path.name}.{tag}.tmp")
        tmp_meta = meta_path.with_name(f".{meta_path.name}.{tag}.tmp")
        size = 0
        try:
            handle = await asyncio.to_thread(_open_for_write, tmp_data)
            try:
                if isinstance(data, bytes):
                    await asyncio.to_thread(handle.write, data)
                    size = len(data)
                else:
                    async for chunk in data:
                        await asyncio.to_thread(handle.write, chunk)
                        size += len(chunk)
                await asyncio.to_thread(_flush, handle)
            finally:
                await asyncio.to_thread(handle.close)
            meta = json.dumps({"content_type": content_type, "size": size}).encode()
            await asyncio.to_thread(_write_file, tmp_meta, meta)
            await asyncio.to_thread(os.replace, tmp_meta, meta_path)
            await asyncio.to_thread(os.replace, tmp_data, data_path)
        except OSError as exc:
            raise StorageError(f"cannot store object: {type(exc).__name__}") from exc
        finally:
            for leftover in (tmp_data, tmp_meta):
                with contextlib.suppress(OSError):
                    leftover.unlink(missing_ok=True)
        return ObjectInfo(key, size, content_type)

    async def stat(self, key: str) -> ObjectInfo | None:
        data_path, meta_path = self._paths(key)
        try:
            return await asyncio.to_thread(_stat, key, data_path, meta_path)
        except OSError as exc:
            raise StorageError(f"cannot stat object: {type(exc).__name__}") from exc

    async def exists(self, key: str) -> bool:
        return await self.stat(key) is not None

    async def read(
        self, key: str, *, offset: int = 0, length: int | None = None, chunk_size: int = 65536
    ) -> AsyncIterator[bytes]:
        data_path, _ = self._paths(key)
        if offset < 0 or (length is not None and length < 0) or chunk_size <= 0:
            raise ValueError("offset and length must not be negative, chunk_size positive")
        try:
            handle = await asyncio.to_thread(data_path.open, "rb")
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
        except OSError as exc:
            raise StorageError(f"cannot read object: {type(exc).__name__}") from exc
        try:
            await asyncio.to_thread(handle.seek, offset)
            remaining = length
            while remaining is None or remaining > 0:
                size = chunk_size if remaining is None else min(chunk_size, remaining)
                try:
                    chunk = await asyncio.to_thread(handle.read, size)
                except OSError as exc:
                    raise StorageError(f"cannot read object: {type(exc).__name__}") from exc
                if not chunk:
                    return
                if remaining is not None:
                    remaining -= len(chunk)
                yield chunk
        finally:
            await asyncio.to_thread(handle.close)

    async def delete(self, key: str) -> bool:
        data_path, meta_path = self._paths(key)
        try:
            existed = await asyncio.to_thread(_unlink, data_path)
            await asyncio.to_thread(_unlink, meta_path)
        except OSError as exc:
            raise StorageError(f"cannot delete object: {type(exc).__name__}") from exc
        return existed


def _open_for_write(path: Path) -> IO[bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("wb")


def _flush(handle: IO[bytes]) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _write_file(path: Path, body: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)


def _stat(key: str, data_path: Path, meta_path: Path) -> ObjectInfo | None:
    try:
        size = data_path.stat().st_size
    except FileNotFoundError:
        return None
    content_type = _DEFAULT_TYPE
    with contextlib.suppress(FileNotFoundError, ValueError):
        content_type = str(json.loads(meta_path.read_bytes()).get("content_type", _DEFAULT_TYPE))
    return ObjectInfo(key, size, content_type)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
