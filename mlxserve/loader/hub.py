"""Hugging Face hub: download only the files a model needs, or use the local cache."""

from __future__ import annotations

import re
from pathlib import Path

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


def download(repo_id: str, filename: str | None = None, revision: str | None = None) -> Path:
    """Local path of a hub repo snapshot (or of one file in it), downloading if needed.

    huggingface_hub shows progress bars and keeps its normal cache; with
    HF_HUB_OFFLINE=1 (or no network) only the cache is used.
    """
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{repo_id}/{filename}" if filename else repo_id
    try:
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
    except LocalEntryNotFoundError:
        raise ValueError(
            f"model {what!r} is not in the local Hugging Face cache and the hub cannot be "
            f"reached (offline: HF_HUB_OFFLINE=1 or no network). Download it once while "
            f"online, or pass a local directory or .gguf file"
        ) from None
