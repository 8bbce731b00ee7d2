"""The filesystem object store passes the object store contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from aivedio.storage import ObjectStore
from aivedio.storage.filesystem import FileSystemObjectStore, FileSystemStoreConfig
from tests.contract.object_store_contract import ObjectStoreContract


class TestFileSystemObjectStore(ObjectStoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> ObjectStore:
        return FileSystemObjectStore(FileSystemStoreConfig(root=tmp_path / "objects"))


async def test_no_temporary_files_are_left_behind(tmp_path: Path) -> None:
    store = FileSystemObjectStore(FileSystemStoreConfig(root=tmp_path))
    await store.put("a/b", b"data", "video/mp4")
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["data/a/b", "meta/a/b.json"]
