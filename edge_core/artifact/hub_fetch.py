"""How are bytes read from the Hub? Bounded range requests, and a safetensors shard's header read by them."""

from __future__ import annotations

import re
import threading
import time
from typing import TYPE_CHECKING

from ..errors import ArtifactError
from .header import MAX_HEADER_BYTES

if TYPE_CHECKING:
    from .hub_settings import HubSettings

#: The first range read of a shard: the length prefix and, for most checkpoints, the whole header.
FIRST_READ_BYTES = 64 * 1024
#: A small file bigger than this is not a config (the reader's own JSON bound is larger; this is the wire's).
MAX_SMALL_FILE_BYTES = 16 * 1024 * 1024


def time_left(deadline: float) -> float:
    """Seconds a request may still take before ``deadline`` (at least 0.05)."""
    return max(deadline - time.monotonic(), 0.05)


class RangeFetcher:
    """Bounded GETs over huggingface_hub's own HTTP session (its auth headers, its proxies)."""

    def __init__(self, repo: str, commit: str, settings: HubSettings, deadline: float):
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        self.repo, self.commit, self.settings, self.fetched = repo, commit, settings, 0
        self.deadline = deadline
        self._count = threading.Lock()
        self.session = get_session()
        self.headers = build_hf_headers()
        self.hf_hub_url = hf_hub_url

    def url(self, name: str) -> str:
        return str(self.hf_hub_url(self.repo, name, revision=self.commit, endpoint=self.settings.endpoint))

    def get(self, name: str, first: int | None = None, last: int | None = None,
            limit: int = MAX_SMALL_FILE_BYTES) -> tuple[bytes, int | None]:
        """The bytes of ``name`` (``first``..``last`` inclusive when given) and the file's total size if said.

        A range answered with anything but 206, or with more bytes than asked for,
        is refused after at most one chunk past the bound: never buffered.
        """
        from huggingface_hub.utils import hf_raise_for_status

        headers = dict(self.headers)
        ranged = False
        if first is not None and last is not None:
            ranged = True
            headers["Range"] = f"bytes={first}-{last}"
            limit = last - first + 1
        with self.session.stream("GET", self.url(name), headers=headers, timeout=time_left(self.deadline),
                                 follow_redirects=True) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            if ranged and response.status_code != 206:
                raise self._hostile(name, f"answered {response.status_code} to a request for bytes {first}-{last} "
                                    "(it ignores HTTP ranges and would send the whole file)")
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise self._hostile(name, f"announces {declared} bytes where at most {limit} were asked for")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                with self._count:
                    self.fetched += len(chunk)
                if len(body) > limit:
                    raise self._hostile(name, f"sent more than the {limit} bytes asked for")
            total = content_range_total(response.headers.get("Content-Range"))
        return bytes(body), total

    def _hostile(self, name: str, what: str) -> ArtifactError:
        return ArtifactError("artifact_invalid", f"{self.settings.endpoint} {what} for {self.repo}/{name}; "
                             "edge stopped reading", "use an endpoint that serves HTTP ranges (the Hub and its "
                             "mirrors do), or download the model and pass its directory", None)


def content_range_total(value: str | None) -> int | None:
    """The total size a ``Content-Range: bytes a-b/total`` header states, or None."""
    match = re.match(r"^bytes \d+-\d+/(\d+)$", (value or "").strip())
    return int(match.group(1)) if match else None


def remote_header(fetcher: RangeFetcher, name: str, listed: int | None) -> tuple[bytes, int]:
    """A shard's length prefix and header, and its total size; refused when the header lies about either."""
    first_last = FIRST_READ_BYTES - 1 if not listed else min(FIRST_READ_BYTES, int(listed)) - 1
    head, total = fetcher.get(name, 0, max(first_last, 7))
    total = total if total is not None else listed
    if total is None or len(head) < 8:
        raise ArtifactError("artifact_invalid", f"{fetcher.repo}/{name}: the server did not say the file's size, "
                            "or sent fewer than 8 bytes", "download the model and pass its directory", None)
    if listed is not None and int(listed) != total:
        raise ArtifactError("artifact_invalid", f"{fetcher.repo}/{name}: the Hub lists {listed} bytes but serves "
                            f"{total}", "download the model and pass its directory", None)
    length = int.from_bytes(head[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise ArtifactError("artifact_invalid", f"{fetcher.repo}/{name} claims a {length}-byte header "
                            f"(limit {MAX_HEADER_BYTES})", "the file is not a valid safetensors file", None)
    if 8 + length > total:
        raise ArtifactError("artifact_invalid", f"{fetcher.repo}/{name} claims a {length}-byte header but the file "
                            f"is only {total} bytes", "the file is not a valid safetensors file", None)
    if len(head) < 8 + length:
        rest, _ = fetcher.get(name, len(head), 8 + length - 1)
        head += rest
    return head[: 8 + length], total
