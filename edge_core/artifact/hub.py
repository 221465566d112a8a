"""Models named by Hub id: found on disk, in the Hugging Face cache, or planned from the Hub's headers alone.

:func:`resolve_model` turns what the user typed into a directory the checkpoint
reader can read, the way vLLM resolves a model name: an existing local path
wins; else the Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``,
``refs/<revision>`` -> ``snapshots/<commit>/``); else the Hub at
``HF_ENDPOINT``, unless ``HF_HUB_OFFLINE`` is set.

From the Hub nothing is downloaded but the small JSON files the reader needs
and each safetensors file's *header*, by HTTP range requests (:mod:`.hub_fetch`). They are written
to edge's metadata cache (``$XDG_CACHE_HOME/edge/hub``, laid out like the
Hugging Face cache) as a snapshot of header-only files: each shard holds its
real header and is then extended, as a sparse hole, to the size the Hub
reports. The ordinary reader then applies every check it applies to local
files, the plan is byte for byte the plan of the real files, and the next plan
of the same commit needs no network. :func:`download` fetches the weights
(only the files vLLM loads) into the Hugging Face cache once a plan admits them.

``huggingface_hub`` is imported only here and only for Hub ids, so planning a
directory costs what it did. What the library does not guard, this module
does: a range request answered with the whole file is cut off after the bytes
asked for and refused, and every remote failure becomes a named refusal within
:data:`~.hub_settings.DEFAULT_TIMEOUT_S`, not a traceback or a 97-second wait.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, UsageError
from ..manifest import ModelSource, transfer_size
from .checkpoint import INDEX_NAME, MODELOPT_CONFIG_NAME, PICKLE_REMEDY, PICKLE_SUFFIXES
from .config import CONFIG_NAME
from .hub_fetch import RangeFetcher, remote_header, time_left
from .hub_settings import HubSettings

#: Slack the worker gets past the deadline to return its own (better named) refusal first.
DEADLINE_SLACK_S = 0.25
#: Header reads in flight at once (a 30-shard checkpoint is read in 4 rounds on loopback, not 30).
FETCH_THREADS = 8
#: JSON files the reader (and the engine's tokenizer) may need for a plan; fetched when the repo has them.
PLAN_FILES = (CONFIG_NAME, INDEX_NAME, MODELOPT_CONFIG_NAME, "generation_config.json", "tokenizer_config.json")
#: What :func:`download` fetches besides the weights: what vLLM reads to start a text model.
ENGINE_FILE_PATTERNS = (
    "*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "vocab*", "merges.txt",
)
#: ``org/name`` as the Hub spells repository ids (names up to 96 characters).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9_.\-]{1,96}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

SOURCE_KINDS = ("local", "cache", "hub")


def looks_like_hub_id(ref: str) -> bool:
    """``org/name`` that is not a path: no leading ``.``, ``/`` or ``~``, one slash, the Hub's characters."""
    return bool(_HUB_ID.match(ref)) and ".." not in ref and not ref.endswith((".onnx", ".git"))


def resolve_model(ref: str, revision: str | None = None, environ: Mapping[str, str] | None = None) -> ModelSource:
    """The directory to plan for ``ref``; raises :class:`ArtifactError` with a named code when there is none."""
    if os.path.lexists(ref) or not looks_like_hub_id(ref):
        if revision is not None:
            raise UsageError(f"--revision applies to Hub ids (org/name); {ref!r} is a local path")
        return ModelSource(kind="local", path=ref)
    settings = HubSettings.from_env(environ)
    cached = _complete_snapshot(settings.cache_dir, ref, revision)
    if cached is not None:
        commit, snapshot = cached
        return ModelSource(kind="cache", path=str(snapshot), repo=ref, revision=revision, commit=commit)
    return _from_hub(ref, revision, settings)


# --------------------------------------------------------------------------- the Hugging Face cache


def _repo_dir(root: Path, repo: str) -> Path:
    return root / ("models--" + repo.replace("/", "--"))


def _cached_commit(root: Path, repo: str, revision: str | None) -> str | None:
    rev = revision or "main"
    if _COMMIT.match(rev):
        return rev
    try:
        commit = (_repo_dir(root, repo) / "refs" / rev).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if _COMMIT.match(commit) else None


def weight_files_of(snapshot: Path) -> list[str] | None:
    """The safetensors files a snapshot's index names (or its top-level ``*.safetensors``); None if unreadable."""
    index = snapshot / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return sorted({str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
    try:
        return sorted(p.name for p in snapshot.iterdir() if p.name.endswith(".safetensors"))
    except OSError:
        return None


def _complete_snapshot(root: Path, repo: str, revision: str | None) -> tuple[str, Path] | None:
    """``(commit, snapshot)`` when the Hugging Face cache holds config.json and every weight file of ``revision``."""
    commit = _cached_commit(root, repo, revision)
    if commit is None:
        return None
    snapshot = _repo_dir(root, repo) / "snapshots" / commit
    if not (snapshot / CONFIG_NAME).is_file():
        return None
    weights = weight_files_of(snapshot)
    if not weights or not all((snapshot / w).is_file() for w in weights):
        return None
    return commit, snapshot


# --------------------------------------------------------------------------- the Hub


def _hub_modules() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise ArtifactError("runtime_dependency_missing", "naming a model by Hub id needs huggingface_hub",
                            "pip install huggingface_hub (edge-core depends on it; the install looks broken)",
                            None) from None
    return huggingface_hub


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection and timeout errors (httpx2 in huggingface_hub 2.x, httpx in 1.x)."""
    errors: list[type[BaseException]] = [OSError, TimeoutError]
    for name in ("httpx2", "httpx"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        errors.append(module.TransportError)
    return tuple(errors)


def _refusal_for(exc: BaseException, repo: str, revision: str | None) -> ArtifactError | None:
    """A named refusal for a Hub error; None when ``exc`` is not one huggingface_hub raises for a request."""
    from huggingface_hub import errors as hf

    rev = revision or "main"
    if isinstance(exc, hf.GatedRepoError):
        return ArtifactError("model_gated", f"{repo} is gated: the Hub wants an access token that has accepted "
                             "its terms", "accept the terms on the model's Hub page, then set HF_TOKEN or run "
                             "`hf auth login`", None)
    if isinstance(exc, hf.RevisionNotFoundError):
        return ArtifactError("revision_not_found", f"{repo} has no revision {rev!r}",
                             "pass an existing branch, tag or commit with --revision (the model's Hub page lists them)",
                             None)
    if isinstance(exc, hf.RepositoryNotFoundError):
        token = "" if os.environ.get("HF_TOKEN") else " (or it is private and no HF_TOKEN is set)"
        return ArtifactError("model_not_found", f"no model {repo!r} on the Hub{token}{local_hint(repo)}",
                             "check the id on the Hub; for a private model set HF_TOKEN or run `hf auth login`; "
                             "for a local directory pass a path that exists (./org/name)", None)
    if isinstance(exc, hf.HfHubHTTPError):
        return ArtifactError("hub_unreachable", f"the Hub answered an error for {repo}: {str(exc).splitlines()[0]}",
                             "retry later, or point HF_ENDPOINT at a mirror", None)
    return None


def _unreachable(repo: str, revision: str | None, settings: HubSettings, exc: BaseException,
                 downloading: bool = False) -> ArtifactError:
    rev = f" --revision {revision}" if revision else ""
    what = (f"lost {settings.endpoint} while downloading {repo} (no answer within {settings.timeout_s:g} s)"
            if downloading else f"could not reach {settings.endpoint} for {repo} within {settings.timeout_s:g} s")
    return ArtifactError(
        "hub_unreachable",
        f"{what} ({type(exc).__name__}: {str(exc)[:160]}){local_hint(repo)}",
        f"check the network (or HF_ENDPOINT; EDGE_HUB_TIMEOUT gives a slow link more seconds); with the model "
        f"already downloaded elsewhere pass its directory; download it with `hf download {repo}{rev}`", None)


def local_hint(ref: str) -> str:
    """For a Hub-shaped ``ref`` that may be a mistyped local path: what of it exists here, and what is near."""
    import difflib

    def near(folder: str, name: str) -> list[str]:
        try:
            entries = [e for e in os.listdir(folder or ".") if not e.startswith(".")]
        except OSError:
            return []
        return difflib.get_close_matches(name, entries, n=3, cutoff=0.6)

    parent, _, name = ref.partition("/")
    if os.path.isdir(parent):
        close = near(parent, name)
        return f"; no local directory {ref} either" + (f" ({parent}/ holds {', '.join(close)})" if close else "")
    close = near("", parent)
    here = f" (here: {', '.join(c + '/' for c in close)})" if close else f" in {os.getcwd()}"
    return f"; no local directory {parent}/ either{here}"


def _not_cached(repo: str, revision: str | None, settings: HubSettings) -> ArtifactError:
    rev = f" --revision {revision}" if revision else ""
    return ArtifactError(
        "model_not_cached",
        f"{repo}{'@' + revision if revision else ''} is not in the Hugging Face cache ({settings.cache_dir}) nor in "
        f"edge's metadata cache, and HF_HUB_OFFLINE is set{local_hint(repo)}",
        f"with network: unset HF_HUB_OFFLINE (edge plans from the headers, ~1 MB), or download it first "
        f"with `hf download {repo}{rev}`", None)


def _edge_snapshot(settings: HubSettings, repo: str, commit: str) -> Path:
    return _repo_dir(settings.edge_cache, repo) / "snapshots" / commit


def _from_metadata_cache(settings: HubSettings, repo: str, revision: str | None) -> ModelSource | None:
    commit = _cached_commit(settings.edge_cache, repo, revision)
    if commit is None:
        return None
    return _metadata_source(settings, repo, revision, commit, fetched=0)


def _metadata_source(settings: HubSettings, repo: str, revision: str | None, commit: str,
                     fetched: int) -> ModelSource | None:
    snapshot = _edge_snapshot(settings, repo, commit)
    try:
        meta = json.loads((snapshot / ".edge-hub.json").read_text())
    except (OSError, ValueError):
        return None
    return ModelSource(kind="hub", path=str(snapshot), repo=repo, revision=revision, commit=commit,
                       weights_present=False, fetched_bytes=fetched, remote_bytes=meta.get("remote_bytes"),
                       weight_files=tuple(meta.get("weight_files") or ()))


def _from_hub(repo: str, revision: str | None, settings: HubSettings) -> ModelSource:
    if settings.offline:
        source = _from_metadata_cache(settings, repo, revision)
        if source is None:
            raise _not_cached(repo, revision, settings)
        return source
    if (revision is not None and _COMMIT.match(revision)) or _fresh_ref(settings, repo, revision):
        # A commit never changes; a branch resolved less than REF_TTL_S ago is taken as it was.
        source = _from_metadata_cache(settings, repo, revision)
        if source is not None:
            return source
    hub = _hub_modules()  # its modules load on first use: here, before the Hub's clock starts
    _ = hub.HfApi, hub.hf_hub_url, hub.utils.get_session, _transport_errors()
    return _within_deadline(repo, revision, settings, time.monotonic() + settings.timeout_s,
                            lambda deadline: _ask_hub(repo, revision, settings, deadline))


def _within_deadline(repo: str, revision: str | None, settings: HubSettings, deadline: float,
                     ask: Any) -> ModelSource:
    """``ask(deadline)`` in a daemon thread; ``hub_unreachable`` once ``deadline`` has passed.

    Each request inside is bounded by what is left (:func:`~.hub_fetch.time_left`), so a request
    still waiting when the decision has returned ends soon after; the thread is
    a daemon, so it never holds the process's exit.
    """
    answer: dict[str, Any] = {}

    def work() -> None:
        try:
            answer["source"] = ask(deadline)
        except BaseException as exc:  # handed to the caller's thread below
            answer["error"] = exc

    worker = threading.Thread(target=work, name="edge-hub", daemon=True)
    worker.start()
    worker.join(deadline - time.monotonic() + DEADLINE_SLACK_S)
    if "error" in answer:
        raise answer["error"]
    if "source" in answer:
        return answer["source"]  # type: ignore[no-any-return]
    raise _unreachable(repo, revision, settings, TimeoutError("no complete answer"))


def _ask_hub(repo: str, revision: str | None, settings: HubSettings, deadline: float) -> ModelSource:
    hub = _hub_modules()
    api = hub.HfApi(endpoint=settings.endpoint)
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True, timeout=time_left(deadline))
    except _transport_errors() as exc:
        if isinstance(exc, hub.errors.HfHubHTTPError):
            refusal = _refusal_for(exc, repo, revision)
            if refusal is not None and refusal.code != "hub_unreachable":
                raise refusal from None
        # As huggingface_hub does offline: a revision planned before is still known.
        source = _from_metadata_cache(settings, repo, revision)
        if source is not None:
            return source
        refusal = _refusal_for(exc, repo, revision)
        raise (refusal or _unreachable(repo, revision, settings, exc)) from None
    commit = str(info.sha)
    source = _metadata_source(settings, repo, revision, commit, fetched=0)
    if source is None:
        source = _fetch_headers(repo, revision, commit, info, settings, deadline)
    _write_ref(settings.edge_cache, repo, revision, commit)
    return source


def _fresh_ref(settings: HubSettings, repo: str, revision: str | None) -> bool:
    """True when edge resolved ``revision`` (a branch or tag) to a commit less than :data:`REF_TTL_S` ago."""
    ref = _repo_dir(settings.edge_cache, repo) / "refs" / (revision or "main")
    try:
        return time.time() - ref.stat().st_mtime < settings.ref_ttl_s
    except OSError:
        return False


def _write_ref(root: Path, repo: str, revision: str | None, commit: str) -> None:
    refs = _repo_dir(root, repo) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    name = revision or "main"
    if _COMMIT.match(name):
        return
    tmp = refs / f".{name.replace('/', '_')}.tmp"
    tmp.write_text(commit)
    target = refs / name
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)


def _fetch_headers(repo: str, revision: str | None, commit: str, info: Any, settings: HubSettings,
                   deadline: float) -> ModelSource:
    sizes = {s.rfilename: s.size for s in (info.siblings or [])}
    if CONFIG_NAME not in sizes:
        raise ArtifactError("config_unreadable", f"{repo} has no config.json at {commit[:12]}",
                            "edge plans Hugging Face-format checkpoints (config.json + safetensors)", None)
    fetcher = RangeFetcher(repo, commit, settings, deadline)
    try:
        small = {name: fetcher.get(name)[0] for name in PLAN_FILES if name in sizes}
        if INDEX_NAME in small:
            try:
                weight_map = json.loads(small[INDEX_NAME])["weight_map"]
                weights = sorted({str(v) for v in weight_map.values()})
            except (ValueError, KeyError, TypeError, AttributeError):
                weights = []  # the reader names what is wrong with the index
        else:
            weights = sorted(n for n in sizes if n.endswith(".safetensors") and "/" not in n)
        if not weights and INDEX_NAME not in small:
            pickles = sorted(n for n in sizes if n.lower().endswith(PICKLE_SUFFIXES))
            if pickles:
                raise ArtifactError("artifact_invalid", f"{repo} has only pickle weights ({', '.join(pickles[:4])}); "
                                    "reading them would execute code, so edge does not open them", PICKLE_REMEDY, None)
            raise ArtifactError("artifact_invalid", f"{repo} has config.json but no *.safetensors weights",
                                "edge plans safetensors checkpoints", None)
        from concurrent.futures import ThreadPoolExecutor

        wanted = [name for name in weights if name in sizes]
        with ThreadPoolExecutor(max_workers=FETCH_THREADS) as pool:
            headers = dict(zip(wanted, pool.map(lambda name: remote_header(fetcher, name, sizes.get(name)), wanted)))
    except _transport_errors() as exc:
        from huggingface_hub import errors as hf

        if isinstance(exc, hf.HfHubHTTPError):
            refusal = _refusal_for(exc, repo, revision)
            if refusal is not None:
                raise refusal from None
        raise _unreachable(repo, revision, settings, exc) from None
    remote = sum(int(sizes[n] or 0) for n in sizes)
    target = _edge_snapshot(settings, repo, commit)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        for name, data in small.items():
            (staging / name).write_bytes(data)
        for name, (header, total) in headers.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(header)
                f.truncate(total)  # the data section as a hole: real size, no disk
        meta = {"repo": repo, "commit": commit, "endpoint": settings.endpoint, "remote_bytes": remote,
                "weight_files": weights, "fetched_bytes": fetcher.fetched}
        (staging / ".edge-hub.json").write_text(json.dumps(meta, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ModelSource(kind="hub", path=str(target), repo=repo, revision=revision, commit=commit,
                       weights_present=False, fetched_bytes=fetcher.fetched, remote_bytes=remote,
                       weight_files=tuple(weights))


# --------------------------------------------------------------------------- downloads


def download_plan(source: ModelSource, settings: HubSettings | None = None) -> tuple[list[str], int]:
    """The files :func:`download` fetches for ``source`` and the bytes still missing from the HF cache."""
    snapshot = Path(source.path)
    try:
        meta = json.loads((snapshot / ".edge-hub.json").read_text())
    except (OSError, ValueError):
        meta = {}
    weights = list(source.weight_files or meta.get("weight_files") or [])
    sizes = {w: (snapshot / w).stat().st_size for w in weights if (snapshot / w).exists()}
    settings = HubSettings.from_env() if settings is None else settings
    have = _repo_dir(settings.cache_dir, source.repo or "") / "snapshots" / (source.commit or "")
    missing = sum(size for name, size in sizes.items() if not (have / name).is_file())
    return weights, missing


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def download(source: ModelSource, environ: Mapping[str, str] | None = None) -> ModelSource:
    """Fetch ``source``'s weights and engine files into the Hugging Face cache; the cache source after.

    Refuses ``disk_space_insufficient`` before anything is fetched when the
    cache's filesystem lacks the room. huggingface_hub writes ``.incomplete``
    blobs and moves them into place only when whole, so an interrupted download
    (Ctrl-C) leaves the cache consistent; the next call resumes it.
    """
    if source.kind != "hub" or source.repo is None or source.commit is None:
        return source
    settings = HubSettings.from_env(environ)
    weights, missing = download_plan(source, settings)
    free = free_bytes(settings.cache_dir)
    if missing > free:
        raise ArtifactError("disk_space_insufficient",
                            f"{source.repo} needs {transfer_size(missing)} more in {settings.cache_dir}, which has "
                            f"{transfer_size(free)} free", "free space there, or point HF_HUB_CACHE at a larger disk", None)
    hub = _hub_modules()
    try:
        path = hub.snapshot_download(source.repo, revision=source.commit, cache_dir=str(settings.cache_dir),
                                     endpoint=settings.endpoint, allow_patterns=[*weights, *ENGINE_FILE_PATTERNS],
                                     etag_timeout=settings.timeout_s)
    except _transport_errors() as exc:
        if isinstance(exc, hub.errors.HfHubHTTPError):
            refusal = _refusal_for(exc, source.repo, source.revision)
            if refusal is not None:
                raise refusal from None
        raise _unreachable(source.repo, source.revision, settings, exc, downloading=True) from None
    # Record the revision the user named (main when none), as `hf download` does: the download asked
    # for the commit, and a later offline plan looks the name up.
    _write_ref(settings.cache_dir, source.repo, source.revision, source.commit)
    return ModelSource(kind="cache", path=str(path), repo=source.repo, revision=source.revision,
                       commit=source.commit)
