"""``listed_sizes``: the sizes of a checkpoint's files from one listing per folder, locally and by URL."""

from __future__ import annotations

from pathlib import Path

from lightning_sharded.checkpoint.backends import LocalBackend, backend_for
from lightning_sharded.checkpoint.backends.paths import Location, listed_sizes


def test_one_listing_per_folder_and_missing_files_left_out(tmp_path: Path) -> None:
    (tmp_path / "index").mkdir()
    (tmp_path / "a.distcp").write_bytes(b"xyz")
    for rank in range(3):
        (tmp_path / "index" / f"rank-{rank:05d}.json").write_bytes(b"{}" * (rank + 1))
    backend = LocalBackend()
    listings: list[Location] = []

    def list_files(loc: Location) -> dict[str, int]:
        listings.append(loc)
        return backend.list_files(loc)

    paths = ["a.distcp", *(f"index/rank-{rank:05d}.json" for rank in range(4)), "gone/x.pt"]
    sizes = listed_sizes(list_files, tmp_path, paths)
    assert sizes == {
        "a.distcp": 3,
        "index/rank-00000.json": 2,
        "index/rank-00001.json": 4,
        "index/rank-00002.json": 6,
    }
    assert listings == [tmp_path, tmp_path / "index", tmp_path / "gone"]
    # A folder listed already is not listed again.
    listings.clear()
    assert listed_sizes(list_files, tmp_path, ["a.distcp"], {"": {"a.distcp": 3}}) == {"a.distcp": 3}
    assert listings == []


def test_a_url_is_listed_by_its_folders() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/ckpt-paths/v/index/rank-00000.json", b"{}")
    fs.pipe("/ckpt-paths/v/meta.pt", b"abcd")
    url = "memory://ckpt-paths/v"
    backend = backend_for(url)
    assert listed_sizes(backend.list_files, url, ["meta.pt", "index/rank-00000.json", "index/x"]) == {
        "meta.pt": 4,
        "index/rank-00000.json": 2,
    }
