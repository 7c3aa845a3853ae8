"""Hugging Face hub: download only the files a model needs, or use the local cache.

Every call to the hub is bounded: before downloading, one metadata request with
huggingface_hub's own timeout (``HF_HUB_ETAG_TIMEOUT``, 10 s by default) and no retries
asks the hub about the model. A hub that refuses, or accepts and never answers, makes
mlxserve use the local cache at once, or fail with one line naming the repo; without
this a silent endpoint hangs forever and an unreachable one costs ~24 s of retries.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger("mlxserve")

# Files a model directory needs; everything else in a repo (PyTorch .bin, ONNX, ...) is skipped.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.txt",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(name: str) -> bool:
    """'owner/name' shape (a hub id rather than a filesystem path)."""
    return bool(_REPO_ID.match(name)) and not name.endswith((".gguf", "/"))


def split_gguf_ref(name: str) -> tuple[str, str] | None:
    """'owner/name/file.gguf' -> ('owner/name', 'file.gguf'), else None."""
    parts = name.split("/")
    if len(parts) >= 3 and name.endswith(".gguf") and is_repo_id("/".join(parts[:2])):
        return "/".join(parts[:2]), "/".join(parts[2:])
    return None


def is_cached(name: str) -> bool:
    """True when ``name`` (owner/name or owner/name/file.gguf) is in the local hub cache.

    Looks at the disk only: no request is made.
    """
    from huggingface_hub.errors import LocalEntryNotFoundError

    ref = split_gguf_ref(name)
    if ref is None and not is_repo_id(name):
        return False
    try:
        _from_cache(*(ref or (name, None)), revision=None)
    except (LocalEntryNotFoundError, ValueError):  # ValueError: not a valid hub id
        return False
    return True


def download(repo_id: str, filename: str | None = None, revision: str | None = None) -> Path:
    """Local path of a hub repo snapshot (or of one file in it), downloading if needed.

    huggingface_hub shows progress bars and keeps its normal cache; with
    HF_HUB_OFFLINE=1, or when the hub does not answer in time, only the cache is used.
    """
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{repo_id}/{filename}" if filename else repo_id
    try:
        trouble = None if constants.HF_HUB_OFFLINE else _ask_hub(repo_id, filename, revision)
        if trouble is not None:
            try:
                path = _from_cache(repo_id, filename, revision)
            except LocalEntryNotFoundError:
                raise ValueError(
                    f"model {what!r} is not in the local Hugging Face cache and the hub at "
                    f"{constants.ENDPOINT} {trouble}. Check the network (or HF_ENDPOINT), "
                    f"or pass a local directory or .gguf file"
                ) from None
            logger.warning("the hub %s: using the cached copy of %s", trouble, what)
            return path
        if filename:
            return Path(hf_hub_download(repo_id, filename, revision=revision))
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise ValueError(
            f"model {what!r} is gated on the Hugging Face hub: accept its license on the "
            f"hub and log in (`hf auth login`) first"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"model {what!r} was not found on the Hugging Face hub (check the name, or "
            f"log in if it is private); it is not a local path either"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"model {what!r} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:  # before EntryNotFoundError: it is a subclass
        raise ValueError(
            f"model {what!r} is not in the local Hugging Face cache and the hub cannot be "
            f"reached (offline: HF_HUB_OFFLINE=1 or no network). Download it once while "
            f"online, or pass a local directory or .gguf file"
        ) from None
    except EntryNotFoundError:
        raise ValueError(
            f"model {what!r}: the hub repo {repo_id!r} has no file {filename!r}"
        ) from None


def _ask_hub(repo_id: str, filename: str | None, revision: str | None) -> str | None:
    """One bounded request about the model, no retries: None when the hub answered, else
    what went wrong ("did not answer within 10 s", ...). The hub's own verdicts (no such
    repo, gated, no such revision or file) are raised for :func:`download` to word."""
    from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    timeout = constants.HF_HUB_ETAG_TIMEOUT
    try:
        if filename:
            get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision), timeout=timeout)
        else:
            HfApi().model_info(repo_id, revision=revision, timeout=timeout)
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        raise
    except HfHubHTTPError as e:  # 5xx, 429, ...: the hub is there but not serving
        status = getattr(getattr(e, "response", None), "status_code", None)
        return f"answered HTTP {status}" if status else f"failed ({_first_line(e)})"
    except Exception as e:  # noqa: BLE001 -- connect/read timeouts, refused, DNS, TLS, ...
        if "timeout" in type(e).__name__.lower() or "timed out" in str(e).lower():
            return f"did not answer within {timeout} s (HF_HUB_ETAG_TIMEOUT)"
        return f"cannot be reached ({_first_line(e)})"
    return None


def _from_cache(repo_id: str, filename: str | None, revision: str | None) -> Path:
    """The cached snapshot (or file); LocalEntryNotFoundError when it is not there."""
    from huggingface_hub import hf_hub_download, snapshot_download

    if filename:
        return Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=True))
    return Path(
        snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=True
        )
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
