"""The fake Hub, checked through huggingface_hub itself: its URLs, headers and error codes must be what it needs.

Every test passes ``endpoint=`` and its own ``cache_dir``, and anonymous calls pass ``token=False``, so nothing
here reads HF_ENDPOINT, HF_TOKEN or the user's cache.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub as hf
import pytest
from factories import KNOWN_CONFIGS, llama_like_tensors, tensor_bytes, tiny_config, write_checkpoint
from fake_hub import FakeHub, FakeRepo
from huggingface_hub import errors
from huggingface_hub.utils import get_session, hf_raise_for_status

REPO, BIG, GATED, PRIVATE, NO_RANGE = "org/tiny", "org/big", "org/gated", "org/private", "org/no-range"
DEV = "d" * 40


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny checkpoint with a sub-folder, and a header-only Llama-3.1-8B (16 GB, sparse)."""
    root = tmp_path_factory.mktemp("repos")
    tiny = write_checkpoint(root / "tiny", tiny_config(), llama_like_tensors(tiny_config()))
    (tiny / "docs").mkdir()
    (tiny / "docs" / "notes.txt").write_text("not weights\n")
    big_config = KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]
    return {"tiny": tiny, "big": write_checkpoint(root / "big", big_config, llama_like_tensors(big_config))}


@pytest.fixture
def hub(checkpoints: dict[str, Path]) -> Iterator[FakeHub]:
    tiny = checkpoints["tiny"]
    repos = {
        REPO: FakeRepo(tiny, revisions={"main": "a" * 40, "dev": DEV}, commit="a" * 40),
        BIG: FakeRepo(checkpoints["big"]),
        GATED: FakeRepo(tiny, gated=True),
        PRIVATE: FakeRepo(tiny, private=True),
        NO_RANGE: FakeRepo(tiny, ignore_range=True),
    }
    with FakeHub(repos) as fake:
        yield fake


def api(hub: FakeHub, token: str | bool = False) -> hf.HfApi:
    return hf.HfApi(endpoint=hub.endpoint, token=token)


def ranged_get(hub: FakeHub, repo: str, name: str, range_header: str, limit: int = 1 << 20):
    """(response, body) of a GET over huggingface_hub's own session, which follows the Hub's redirects.

    Reads at most ``limit`` bytes: a fake that ignored the range on a 16 GB file must fail, not fill the memory.
    """
    url = hf.hf_hub_url(repo, name, endpoint=hub.endpoint)
    with get_session().stream("GET", url, headers={"Range": range_header}) as response:
        body = b""
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > limit:
                pytest.fail(f"{range_header} of {repo}/{name}: more than {limit} bytes came back")
    return response, body


# ---------------------------------------------------------------- info and listing


def test_model_info_gives_the_commit_and_sizes_only_with_files_metadata(hub: FakeHub, checkpoints):
    tiny = checkpoints["tiny"]
    info = api(hub).model_info(REPO, files_metadata=True)
    assert info.sha == "a" * 40
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == {"config.json", "model.safetensors", "docs/notes.txt"}
    assert {n: s.size for n, s in siblings.items()} == {n: os.path.getsize(tiny / n) for n in siblings}
    config = (tiny / "config.json").read_bytes()
    assert siblings["config.json"].blob_id == git_blob_id(config) and siblings["config.json"].lfs is None
    weights = siblings["model.safetensors"].lfs
    weights_sha256 = hashlib.sha256((tiny / "model.safetensors").read_bytes()).hexdigest()
    assert weights is not None and weights.sha256 == weights_sha256

    plain = api(hub).model_info(REPO)
    assert {s.rfilename for s in plain.siblings} == set(siblings)
    assert all(s.size is None for s in plain.siblings)
    assert hub.requests[-1][1] == f"/api/models/{REPO}"


def test_revisions_resolve_by_branch_and_by_full_commit(hub: FakeHub):
    assert api(hub).model_info(REPO, revision="dev").sha == DEV
    assert api(hub).model_info(REPO, revision=DEV).sha == DEV
    default = hashlib.sha1(BIG.encode()).hexdigest()
    assert api(hub).model_info(BIG).sha == default == hub.repos[BIG].commit


def test_tree_listing_recursive_and_by_folder(hub: FakeHub):
    assert api(hub).list_repo_files(REPO) == ["config.json", "docs/notes.txt", "model.safetensors"]
    top = {entry.path: type(entry).__name__ for entry in api(hub).list_repo_tree(REPO)}
    assert top == {"config.json": "RepoFile", "docs": "RepoFolder", "model.safetensors": "RepoFile"}
    [notes] = api(hub).list_repo_tree(REPO, path_in_repo="docs")
    assert (notes.path, notes.size) == ("docs/notes.txt", len("not weights\n"))


def test_file_exists(hub: FakeHub):
    assert api(hub).file_exists(REPO, "docs/notes.txt")
    assert api(hub).file_exists(REPO, "model.safetensors")  # an LFS file: answered by a redirect
    assert not api(hub).file_exists(REPO, "missing.bin")
    assert not api(hub).file_exists("org/absent", "config.json")


# ---------------------------------------------------------------- downloads


def test_hf_hub_download_fills_the_cache_layout(hub: FakeHub, checkpoints, tmp_path: Path):
    tiny = checkpoints["tiny"]
    storage = tmp_path / "models--org--tiny"
    for name in ("config.json", "model.safetensors"):
        path = Path(hf.hf_hub_download(REPO, name, cache_dir=tmp_path, endpoint=hub.endpoint, token=False))
        assert path == storage / "snapshots" / ("a" * 40) / name
        assert path.is_symlink() and path.read_bytes() == (tiny / name).read_bytes()
    assert (storage / "refs" / "main").read_text() == "a" * 40
    data = (tiny / "model.safetensors").read_bytes()
    blobs = {p.name for p in (storage / "blobs").iterdir()}
    assert blobs == {git_blob_id((tiny / "config.json").read_bytes()), hashlib.sha256(data).hexdigest()}


def test_lfs_download_goes_to_another_origin_without_the_token(hub: FakeHub, tmp_path: Path):
    hf.hf_hub_download(REPO, "model.safetensors", cache_dir=tmp_path, endpoint=hub.endpoint, token=hub.token)
    (head, resolve, _), (get, cdn_path, cdn_headers) = hub.requests
    assert (head, resolve) == ("HEAD", f"/{REPO}/resolve/main/model.safetensors")
    assert get == "GET" and cdn_path.startswith("/lfs/") and "Authorization" not in cdn_headers


def test_download_by_branch_and_commit(hub: FakeHub, tmp_path: Path):
    hf.hf_hub_download(REPO, "config.json", revision="dev", cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    storage = tmp_path / "models--org--tiny"
    assert (storage / "refs" / "dev").read_text() == DEV
    path = hf.hf_hub_download(REPO, "config.json", revision="a" * 40, cache_dir=tmp_path, endpoint=hub.endpoint,
                              token=False)
    assert Path(path).parent == storage / "snapshots" / ("a" * 40)
    assert not (storage / "refs" / "main").exists()  # a commit is no ref


def test_snapshot_download_fetches_only_the_allowed_files(hub: FakeHub, tmp_path: Path):
    folder = Path(hf.snapshot_download(REPO, revision="dev", allow_patterns=["*.json", "docs/*"], cache_dir=tmp_path,
                                       endpoint=hub.endpoint, token=False))
    assert folder.name == DEV
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "config.json", "docs/notes.txt"]
    assert not any("safetensors" in path or path.startswith("/lfs/") for _, path, _ in hub.requests)


def test_safetensors_metadata_of_a_sparse_16_gb_file_costs_only_its_header(hub: FakeHub, checkpoints):
    config = KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]
    tensors = llama_like_tensors(config)
    size = os.path.getsize(checkpoints["big"] / "model.safetensors")
    assert size > 15e9
    # huggingface_hub reads a 200 to its range request whole into memory: make sure ranges work first.
    assert ranged_get(hub, BIG, "model.safetensors", "bytes=0-7")[0].status_code == 206
    hub.reset_counters()
    started = time.monotonic()
    metadata = api(hub).get_safetensors_metadata(BIG)
    assert time.monotonic() - started < 5
    parsed = metadata.files_metadata["model.safetensors"].tensors
    assert {name: (t.dtype, t.shape) for name, t in parsed.items()} == {n: (d, s) for n, (d, s) in tensors.items()}
    assert sum(metadata.parameter_count.values()) * 2 == sum(tensor_bytes(*spec) for spec in tensors.values())
    assert hub.bytes_sent <= 100_001 + 1_000  # one ranged read of the header, plus nothing but small JSON


# ---------------------------------------------------------------- ranges


@pytest.mark.parametrize(("repo", "name"), [(REPO, "config.json"), (BIG, "model.safetensors")])
@pytest.mark.parametrize("shape", ["first-last", "suffix", "open-ended"])
def test_range_get_answers_206_with_exactly_the_bytes_asked(hub: FakeHub, checkpoints, repo, name, shape):
    file = checkpoints["tiny" if repo == REPO else "big"] / name
    size = os.path.getsize(file)
    range_header, first, last = {"first-last": ("bytes=0-99", 0, 99), "suffix": ("bytes=-16", size - 16, size - 1),
                                 "open-ended": (f"bytes={size - 300}-", size - 300, size - 1)}[shape]
    hub.reset_counters()
    response, body = ranged_get(hub, repo, name, range_header)
    assert response.status_code == 206
    assert response.headers["Content-Range"] == f"bytes {first}-{last}/{size}"
    assert int(response.headers["Content-Length"]) == last - first + 1
    with file.open("rb") as f:
        f.seek(first)
        assert body == f.read(last - first + 1)
    assert hub.bytes_sent == last - first + 1
    assert all(headers.get("Range") == range_header for _, _, headers in hub.requests)


def test_unsatisfiable_range_is_416(hub: FakeHub, checkpoints):
    size = os.path.getsize(checkpoints["tiny"] / "config.json")
    response, _ = ranged_get(hub, REPO, "config.json", f"bytes={size}-")
    assert response.status_code == 416 and response.headers["Content-Range"] == f"bytes */{size}"
    with pytest.raises(errors.HfHubHTTPError) as raised:
        hf_raise_for_status(response)
    assert raised.value.response.status_code == 416


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_ignore_range_answers_200_with_the_whole_file(hub: FakeHub, checkpoints, name):
    data = (checkpoints["tiny"] / name).read_bytes()
    hub.reset_counters()
    response, body = ranged_get(hub, NO_RANGE, name, "bytes=0-99", limit=len(data))
    assert response.status_code == 200 and "Content-Range" not in response.headers
    assert body == data and hub.bytes_sent == len(data)


def test_a_client_leaving_mid_stream_counts_only_what_was_written(hub: FakeHub):
    url = hf.hf_hub_url(BIG, "model.safetensors", endpoint=hub.endpoint)
    with get_session().stream("GET", url) as response:
        assert response.status_code == 200
        received = len(next(response.iter_bytes()))
    settled, previous = time.monotonic() + 5, -1
    while hub.bytes_sent != previous and time.monotonic() < settled:
        previous = hub.bytes_sent
        time.sleep(0.1)
    assert received <= hub.bytes_sent < 256 << 20  # socket buffers at most, of a 16 GB body


# ---------------------------------------------------------------- errors and access


def _download(hub: FakeHub, tmp_path: Path, repo: str, name: str = "config.json", revision: str | None = None):
    return hf.hf_hub_download(repo, name, revision=revision, cache_dir=tmp_path, endpoint=hub.endpoint, token=False)


@pytest.mark.parametrize(("call", "expected"), [
    (lambda hub, tmp: api(hub).model_info("org/absent"), errors.RepositoryNotFoundError),
    (lambda hub, tmp: _download(hub, tmp, "org/absent"), errors.RepositoryNotFoundError),
    (lambda hub, tmp: api(hub).model_info(REPO, revision="nope"), errors.RevisionNotFoundError),
    (lambda hub, tmp: _download(hub, tmp, REPO, revision="nope"), errors.RevisionNotFoundError),
    (lambda hub, tmp: list(api(hub).list_repo_tree(REPO, revision="nope")), errors.RevisionNotFoundError),
    (lambda hub, tmp: _download(hub, tmp, REPO, "missing.json"), errors.RemoteEntryNotFoundError),
    (lambda hub, tmp: list(api(hub).list_repo_tree(REPO, path_in_repo="nowhere")), errors.RemoteEntryNotFoundError),
    (lambda hub, tmp: _download(hub, tmp, GATED), errors.GatedRepoError),
    (lambda hub, tmp: api(hub).file_exists(GATED, "config.json"), errors.GatedRepoError),
    (lambda hub, tmp: api(hub).get_safetensors_metadata(GATED), errors.GatedRepoError),
    (lambda hub, tmp: api(hub).model_info(PRIVATE), errors.RepositoryNotFoundError),
    (lambda hub, tmp: _download(hub, tmp, PRIVATE), errors.RepositoryNotFoundError),
    (lambda hub, tmp: hf.snapshot_download(PRIVATE, cache_dir=tmp, endpoint=hub.endpoint, token=False),
     errors.RepositoryNotFoundError),
])
def test_errors_are_huggingface_hubs_own(hub: FakeHub, tmp_path: Path, call, expected):
    with pytest.raises(expected) as raised:
        call(hub, tmp_path)
    assert raised.type is expected  # GatedRepoError subclasses RepositoryNotFoundError: no looser match
    assert issubclass(errors.RemoteEntryNotFoundError, errors.EntryNotFoundError)


def test_gated_repo_lists_publicly_and_serves_files_with_the_token(hub: FakeHub, checkpoints, tmp_path: Path):
    """As on the Hub: a gated repo's info and tree are public, its files need an authorized token."""
    info = api(hub).model_info(GATED, files_metadata=True)
    assert info.gated == "manual" and len(info.siblings) == 3
    path = hf.hf_hub_download(GATED, "config.json", cache_dir=tmp_path, endpoint=hub.endpoint, token=hub.token)
    assert Path(path).read_bytes() == (checkpoints["tiny"] / "config.json").read_bytes()
    assert api(hub, hub.token).get_safetensors_metadata(GATED).sharded is False
    with pytest.raises(errors.GatedRepoError):
        hf.hf_hub_download(GATED, "config.json", cache_dir=tmp_path / "other", endpoint=hub.endpoint,
                           token="hf_wrong_token")


def test_private_repo_with_the_token(hub: FakeHub, tmp_path: Path):
    info = api(hub, hub.token).model_info(PRIVATE)
    assert info.private is True and info.sha == hub.repos[PRIVATE].commit
    folder = hf.snapshot_download(PRIVATE, allow_patterns="*.json", cache_dir=tmp_path, endpoint=hub.endpoint,
                                  token=hub.token)
    assert os.listdir(folder) == ["config.json"]


def test_delay_makes_a_short_timeout_fail(checkpoints):
    client = importlib.import_module(type(get_session()).__module__.split(".")[0])  # httpx2, or httpx in hf_hub 1.x
    with FakeHub({REPO: FakeRepo(checkpoints["tiny"])}, delay_s=0.3) as slow:
        with pytest.raises(client.TimeoutException):
            api(slow).model_info(REPO, timeout=0.05)
        assert api(slow).model_info(REPO, timeout=5).sha == slow.repos[REPO].commit
