"""Tests for edge_core.artifact.header_cache: a manifest read from a cached verdict is the one the checks give.

Every test points ``XDG_CACHE_HOME`` at its own directory and caches
checkpoints of any size (the real threshold is a megabyte of header JSON).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from factories import llama_like_tensors, tiny_config, write_checkpoint, write_safetensors_header_only

from edge_core.artifact import checkpoint, header_cache, read_manifest
from edge_core.errors import ArtifactError


@pytest.fixture(autouse=True)
def _xdg_decides(monkeypatch):
    """These tests place the cache through XDG_CACHE_HOME; the suite-wide override (conftest) steps aside."""
    monkeypatch.delenv(header_cache.CACHE_DIR_ENV, raising=False)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(header_cache, "MIN_CACHED_BYTES", 0)
    return tmp_path / "xdg" / "edge" / "headers"


@pytest.fixture
def no_parse(monkeypatch):
    """Makes any header parse fail loudly: a read that succeeds under it used the cache."""

    def refuse(root, shard):
        raise AssertionError(f"parsed {shard.name}")

    def arm():
        monkeypatch.setattr(checkpoint, "check_header", refuse)

    return arm


def sharded(root: Path, shards: int = 2) -> Path:
    config = tiny_config()
    return write_checkpoint(root, config, llama_like_tensors(config), shards=shards)


def entry_of(cache: Path, root: Path, suffix: str = ".json") -> Path:
    key = header_cache.cache_key((root / "model.safetensors.index.json").read_bytes(), [])
    assert key is not None
    return cache / f"{key[:40]}{suffix}"


def entries(cache: Path, suffix: str = ".json") -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.name.endswith(suffix)) if cache.exists() else []


def rewrite_header(path: Path, old: bytes, new: bytes) -> None:
    """Replace bytes inside a shard's header in place, same length, keeping the file's mtime."""
    assert len(old) == len(new)
    st = path.stat()
    with open(path, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        raw = f.read(length)
        assert raw.count(old) == 1, old
        f.seek(8)
        f.write(raw.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_second_read_takes_the_verdict_and_gives_the_same_manifest(tmp_path, cache, no_parse):
    root = sharded(tmp_path / "m")
    first = read_manifest(root)
    assert len(entries(cache)) == 1
    no_parse()
    second = read_manifest(root)
    assert second.to_dict() == first.to_dict()
    assert list(second.tensors) == list(first.tensors)  # parsed then, from the bytes it verified


def test_a_copy_elsewhere_shares_the_entry(tmp_path, cache, no_parse):
    read_manifest(sharded(tmp_path / "a"))
    no_parse()
    read_manifest(sharded(tmp_path / "b"))
    assert len(entries(cache)) == 1


def test_a_header_changed_in_place_is_checked_again_and_refused(tmp_path, cache):
    root = sharded(tmp_path / "m")
    read_manifest(root)
    # Same length, same mtime: only the bytes say the shape no longer matches the tensor's bytes.
    rewrite_header(root / "model-00002-of-00002.safetensors", b'"model.norm.weight":{"dtype":"BF16","shape":[256]',
                   b'"model.norm.weight":{"dtype":"BF16","shape":[257]')
    with pytest.raises(ArtifactError) as info:
        read_manifest(root)
    assert "shape needs" in info.value.message


def test_a_valid_change_in_place_gives_the_new_manifest(tmp_path, cache):
    root = sharded(tmp_path / "m")
    before = read_manifest(root)
    rewrite_header(root / "model-00002-of-00002.safetensors", b'"model.norm.weight":{"dtype":"BF16"',
                   b'"model.norm.weight":{"dtype":"F16" ')
    after = read_manifest(root)
    assert after.dtype_bytes["F16"] == 512 and after.dtype_bytes["BF16"] == before.dtype_bytes["BF16"] - 512
    assert after.artifact_id != before.artifact_id
    assert read_manifest(root).to_dict() == after.to_dict()


def test_an_index_edited_after_the_verdict_is_checked_again(tmp_path, cache):
    root = sharded(tmp_path / "m")
    read_manifest(root)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ArtifactError) as info:
        read_manifest(root)
    assert "does not hold" in info.value.message


def test_a_stray_shard_added_after_the_verdict_is_refused(tmp_path, cache):
    config = tiny_config()
    root = write_checkpoint(tmp_path / "m", config, llama_like_tensors(config))
    read_manifest(root)
    write_safetensors_header_only(root / "stray.safetensors", {"model.norm.weight": ("BF16", [256])})
    with pytest.raises(ArtifactError) as info:
        read_manifest(root)
    assert "both" in info.value.message


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b'{"format": "edge-header-verdict-v1"}', b"\xff" * 40,
                                     b"null", b'{"format": "edge-header-verdict-v1", "key": "x", "shards": []}'])
def test_a_corrupted_entry_is_ignored_and_replaced(tmp_path, cache, content):
    root = sharded(tmp_path / "m")
    first = read_manifest(root)
    (entry,) = entries(cache)
    entry.write_bytes(content)
    assert read_manifest(root).to_dict() == first.to_dict()
    assert json.loads(entry.read_bytes())["format"] == header_cache.ENTRY_FORMAT


def test_an_entry_that_lies_about_the_bytes_is_not_trusted(tmp_path, cache):
    root = sharded(tmp_path / "m")
    first = read_manifest(root)
    (entry,) = entries(cache)
    doc = json.loads(entry.read_bytes())
    doc["dtype_bytes"] = {"BF16": 1}
    doc["shards"][0][2] = "0" * 64  # a digest no header has
    entry.write_text(json.dumps(doc))
    assert read_manifest(root).dtype_bytes == first.dtype_bytes


def test_an_entry_for_other_headers_is_not_read_as_this_ones(tmp_path, cache):
    a, b = sharded(tmp_path / "a", shards=2), sharded(tmp_path / "b", shards=3)
    expected = read_manifest(a).to_dict()
    read_manifest(b)
    entry_of(cache, a).write_bytes(entry_of(cache, b).read_bytes())  # a's file name, b's key and verdict inside
    assert read_manifest(a).to_dict() == expected
    doc = json.loads(entry_of(cache, b).read_bytes())
    doc["key"] = json.loads(entry_of(cache, a).read_bytes())["key"]
    entry_of(cache, a).write_text(json.dumps(doc))  # a's key, b's verdict: b's shards do not verify against a's
    assert read_manifest(a).to_dict() == expected


def test_an_unwritable_cache_is_no_reason_to_fail(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(header_cache, "MIN_CACHED_BYTES", 0)
    root = sharded(tmp_path / "m")
    assert read_manifest(root).to_dict() == read_manifest(root).to_dict()


def test_small_checkpoints_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    read_manifest(sharded(tmp_path / "m"))
    assert not (tmp_path / "xdg" / "edge" / "headers").exists()


def test_the_least_recently_used_checkpoints_are_dropped(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(header_cache, "MAX_ENTRIES", 2)
    roots = [sharded(tmp_path / f"m{n}", shards=n) for n in (2, 3, 4)]
    for age, root in enumerate(roots[:2]):
        read_manifest(root)
        list(read_manifest(root).tensors)  # a verdict and its columns
        for suffix in (".json", ".tensors"):
            os.utime(entry_of(cache, root, suffix), ns=(10**18 + age, 10**18 + age))  # m2 older than m3
    read_manifest(roots[2])
    assert not entry_of(cache, roots[0]).exists() and not entry_of(cache, roots[0], ".tensors").exists()
    assert entry_of(cache, roots[1]).exists() and entry_of(cache, roots[2]).exists()


# ---------------------------------------------------------------- the tensor columns


def test_tensor_columns_are_kept_once_read_and_loaded_without_a_parse(tmp_path, cache, no_parse, monkeypatch):
    root = sharded(tmp_path / "m", shards=3)
    first = read_manifest(root)
    assert entries(cache, ".tensors") == []  # nobody asked for them yet
    expected = list(first.tensors)
    assert len(entries(cache, ".tensors")) == 1
    no_parse()
    monkeypatch.setattr("edge_core.artifact.header.check_header", lambda root, shard: pytest.fail("parsed"))
    assert list(read_manifest(root).tensors) == expected


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "swap_names"])
def test_damaged_tensor_columns_are_ignored(tmp_path, cache, damage):
    root = sharded(tmp_path / "m")
    expected = list(read_manifest(root).tensors)
    (table,) = entries(cache, ".tensors")
    data = bytearray(table.read_bytes())
    if damage == "truncate":
        data = data[:-9]
    elif damage == "flip":
        data[-3] ^= 0xFF  # inside the dims column: every length and sum still agrees, the digest does not
    elif damage == "garbage":
        data = bytearray(b"\0" * 64)
    else:
        data = data.replace(b"model.norm.weight", b"model.norm.wEight")
    table.write_bytes(bytes(data))
    got = list(read_manifest(root).tensors)
    assert got == expected


def test_tensor_columns_from_before_a_header_change_are_not_used(tmp_path, cache):
    root = sharded(tmp_path / "m")
    list(read_manifest(root).tensors)
    rewrite_header(root / "model-00002-of-00002.safetensors", b'"model.norm.weight":{"dtype":"BF16"',
                   b'"model.norm.weight":{"dtype":"F16" ')
    tensors = {t.name: t for t in read_manifest(root).tensors}
    assert tensors["model.norm.weight"].dtype == "F16"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_in_place_of_an_entry_does_not_block(tmp_path, cache):
    root = sharded(tmp_path / "m")
    expected = read_manifest(root).to_dict()
    entry = entry_of(cache, root)
    entry.unlink()
    os.mkfifo(entry)
    assert read_manifest(root).to_dict() == expected


def test_an_entry_whose_bytes_do_not_add_up_to_the_data_sections_is_not_trusted(tmp_path, cache):
    root = sharded(tmp_path / "m")
    first = read_manifest(root)
    entry = entry_of(cache, root)
    doc = json.loads(entry.read_bytes())
    doc["dtype_bytes"] = {"BF16": doc["dtype_bytes"]["BF16"] + 2}  # the digests still match the headers
    entry.write_text(json.dumps(doc))
    assert read_manifest(root).dtype_bytes == first.dtype_bytes


@pytest.mark.parametrize("entries_of_w, data_bytes, needle", [
    ({"dtype": "Q4_K", "shape": [2, 2], "data_offsets": [0, 16]}, 16, "unknown dtype"),
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}, 16, "shape needs"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, 20, "trailing"),
])
def test_a_refused_header_leaves_no_verdict(tmp_path, cache, entries_of_w, data_bytes, needle):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    raw = json.dumps({"w": entries_of_w}).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"\0" * data_bytes)
    for _ in range(2):  # and the second read refuses it again, by name
        with pytest.raises(ArtifactError) as info:
            read_manifest(tmp_path)
        assert needle in info.value.message
    assert entries(cache) == []


def test_edge_header_cache_dir_overrides_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(header_cache.CACHE_DIR_ENV, str(tmp_path / "chosen"))
    assert header_cache.default_cache_dir() == tmp_path / "chosen"
