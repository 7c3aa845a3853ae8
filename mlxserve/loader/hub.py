"""Hugging Face hub: download only the files a model needs, resumably, or use the local cache.

Every call to the hub is bounded: before downloading, one metadata request with
huggingface_hub's own timeout (``HF_HUB_ETAG_TIMEOUT``, 10 s by default) and no retries
asks the hub about the model (its commit and file list). A hub that refuses, or accepts and
never answers, makes :func:`download` use the local cache at once, or fail with one line
naming the repo; without this a silent endpoint hangs forever and an unreachable one costs
~24 s of retries. :func:`pull` (``mlxserve pull``) never falls back: it fails with one line.

Files go into huggingface_hub's normal cache layout (``models--owner--name/blobs/<etag>``,
``snapshots/<commit>/<file>`` links, ``refs/<revision>``), so the hub's own tools see them.
A blob is written to ``<etag>.incomplete`` first and kept when a download stops: the next
pull asks for the rest with an HTTP Range request instead of starting again
(huggingface_hub itself deletes a partial file).
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

logger = logging.getLogger("mlxserve")

# A download's progress: (file name, bytes there, the file's size when known).
Progress = Callable[[str, int, "int | None"], None]

if TYPE_CHECKING:
    from huggingface_hub.hf_api import ModelInfo, RepoSibling

# Files a model directory needs; everything else in a repo (PyTorch .bin, ONNX, ...) is skipped.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.txt",
    "README.md",  # the model card: its license
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHUNK_BYTES = 1 << 20


def is_repo_id(name: str) -> bool:
    """'owner/name' shape (a hub id rather than a filesystem path)."""
    return bool(_REPO_ID.match(name)) and not name.endswith((".gguf", "/"))


def split_gguf_ref(name: str) -> tuple[str, str] | None:
    """'owner/name/file.gguf' or 'owner/name:file.gguf' -> ('owner/name', 'file.gguf'),
    else None."""
    repo_id, colon, filename = name.partition(":")
    if colon and is_repo_id(repo_id) and filename.endswith(".gguf"):
        return repo_id, filename
    parts = name.split("/")
    if len(parts) >= 3 and name.endswith(".gguf") and is_repo_id("/".join(parts[:2])):
        return "/".join(parts[:2]), "/".join(parts[2:])
    return None


def parse_pull_name(name: str, quant: str | None = None) -> tuple[str, str | None, str | None]:
    """(repo id, GGUF file or None, quant or None) of a name to pull: ``owner/name``,
    ``owner/name:FILE.gguf`` / ``owner/name/FILE.gguf``, or Ollama's spelling of a hub GGUF,
    ``hf.co/owner/name:QUANT``; ValueError for anything else."""
    model = name.removeprefix("hf.co/").removeprefix("huggingface.co/")
    repo, colon, tail = model.partition(":")
    if colon and is_repo_id(repo) and not tail.endswith(".gguf"):
        model, quant = repo, quant or tail
    ref = split_gguf_ref(model)
    if ref is None and not is_repo_id(model):
        raise ValueError(
            f"{name!r} is not a hub model: give owner/name, owner/name:FILE.gguf or "
            f"owner/name:QUANT"
        )
    repo_id, filename = ref or (model, None)
    return repo_id, filename, quant


def cache_name(repo_id: str, path: Path) -> str:
    """The name `mlxserve list` gives what :func:`pull` returned: the repo id, or
    ``owner/name/FILE.gguf`` for one GGUF file."""
    if not path.is_file():
        return repo_id
    snapshots = repo_cache_dir(repo_id) / "snapshots"  # .../snapshots/<commit>/<file>
    return f"{repo_id}/{Path(*path.relative_to(snapshots).parts[1:]).as_posix()}"


def repo_cache_dir(repo_id: str) -> Path:
    """The cache folder of a model repo (``$HF_HUB_CACHE/models--owner--name``)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


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

    Progress bars show each file's size and speed; with HF_HUB_OFFLINE=1, or when the hub
    does not answer in time, only the cache is used.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    what = f"{repo_id}/{filename}" if filename else repo_id
    with _hub_errors(what, revision):
        info, trouble = (None, None) if constants.HF_HUB_OFFLINE else _ask_hub(repo_id, revision)
        if info is None:
            try:
                path = _from_cache(repo_id, filename, revision)
            except LocalEntryNotFoundError:
                if trouble is None:
                    raise
                raise ValueError(
                    f"model {what!r} is not in the local Hugging Face cache and the hub at "
                    f"{constants.ENDPOINT} {trouble}. Check the network (or HF_ENDPOINT), "
                    f"or pass a local directory or .gguf file"
                ) from None
            if trouble is not None:
                logger.warning("the hub %s: using the cached copy of %s", trouble, what)
            return path
        return fetch(info, repo_id, filename, revision=revision)


def pull(
    repo_id: str,
    filename: str | None = None,
    quant: str | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Download a model (a repo's model files, or one GGUF file of it) into the cache.

    Unlike :func:`download` it never settles for the cache: offline or an unreachable hub
    is a one-line ValueError. Returns the snapshot directory or the GGUF file.
    ``progress`` hears of every file's bytes as they come (a server's pull streams them).
    """
    from huggingface_hub import constants

    what = f"{repo_id}/{filename}" if filename else repo_id
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"cannot pull {what!r}: offline mode is on (HF_HUB_OFFLINE=1)")
    with _hub_errors(what, revision):
        info, trouble = _ask_hub(repo_id, revision)
        if info is None:
            raise ValueError(
                f"cannot pull {what!r}: the hub at {constants.ENDPOINT} {trouble}. "
                f"Check the network (or HF_ENDPOINT)"
            )
        return fetch(info, repo_id, filename, quant, revision, progress)


@contextmanager
def _hub_errors(what: str, revision: str | None) -> Iterator[None]:
    """The hub's verdicts (no such repo, gated, ...) as one-line ValueErrors."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
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
        raise ValueError(f"model {what!r}: the hub has no such file") from None


def _ask_hub(repo_id: str, revision: str | None) -> tuple[ModelInfo | None, str | None]:
    """One bounded request for the repo's commit and files, no retries: (info, None) when
    the hub answered, else (None, what went wrong: "did not answer within 10 s", ...). The
    hub's own verdicts (no such repo, gated, no such revision) are raised for the caller."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    timeout = constants.HF_HUB_ETAG_TIMEOUT
    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, timeout=timeout)
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        raise
    except HfHubHTTPError as e:  # 5xx, 429, ...: the hub is there but not serving
        status = getattr(getattr(e, "response", None), "status_code", None)
        return None, f"answered HTTP {status}" if status else f"failed ({_first_line(e)})"
    except Exception as e:  # noqa: BLE001 -- connect/read timeouts, refused, DNS, TLS, ...
        if "timeout" in type(e).__name__.lower() or "timed out" in str(e).lower():
            return None, f"did not answer within {timeout} s (HF_HUB_ETAG_TIMEOUT)"
        return None, f"cannot be reached ({_first_line(e)})"
    return info, None


def select_files(
    info: ModelInfo, repo_id: str, filename: str | None = None, quant: str | None = None
) -> list[RepoSibling]:
    """The files of a repo a model needs: the named file; the GGUF file whose name carries
    ``quant`` (Q4_K_M, ...); the model directory's files (ALLOW_PATTERNS) when the repo has
    a config.json; else the repo's only GGUF file."""
    files = {s.rfilename: s for s in info.siblings or []}
    ggufs = sorted(name for name in files if name.endswith(".gguf"))
    if filename:
        if filename not in files:
            raise ValueError(f"model {f'{repo_id}/{filename}'!r}: the hub repo has no such file")
        return [files[filename]]
    if quant:
        tag = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
        matching = [name for name in ggufs if tag.search(Path(name).stem)]
        if len(matching) != 1:
            found = f"several match: {', '.join(matching)}" if matching else "none matches"
            raise ValueError(
                f"{repo_id}: {found} --quant {quant} among its GGUF files "
                f"({', '.join(ggufs) or 'none'}); name one as {repo_id}:FILE"
            )
        return [files[matching[0]]]
    if "config.json" in files:
        return [
            s
            for name, s in files.items()
            if any(fnmatch.fnmatch(name, pattern) for pattern in ALLOW_PATTERNS)
        ]
    if len(ggufs) == 1:
        return [files[ggufs[0]]]
    if ggufs:
        raise ValueError(
            f"{repo_id} holds several GGUF files ({', '.join(ggufs)}); pick one with "
            f"--quant (e.g. Q4_K_M) or as {repo_id}:FILE"
        )
    raise ValueError(f"{repo_id} has no config.json and no .gguf file: no model to download")


def fetch(
    info: ModelInfo,
    repo_id: str,
    filename: str | None = None,
    quant: str | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Download :func:`select_files` into the cache: the snapshot directory, or the one
    GGUF file when the selection is one."""
    if not info.sha:
        raise ValueError(f"{repo_id}: the hub did not say which commit it serves")
    files = select_files(info, repo_id, filename, quant)
    repo_dir = repo_cache_dir(repo_id)
    snapshot = repo_dir / "snapshots" / str(info.sha)
    for sibling in files:
        _fetch_file(repo_id, str(info.sha), sibling, repo_dir, snapshot, progress)
    ref = repo_dir / "refs" / (revision or "main")
    if revision != info.sha:
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(str(info.sha))
    is_one_gguf = len(files) == 1 and files[0].rfilename.endswith(".gguf")
    return snapshot / files[0].rfilename if is_one_gguf else snapshot


def _fetch_file(
    repo_id: str,
    commit: str,
    sibling: RepoSibling,
    repo_dir: Path,
    snapshot: Path,
    progress: Progress | None = None,
) -> None:
    """One file: its blob (downloaded unless there) and its link in the snapshot."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(repo_id, sibling.rfilename, revision=commit)
    sha256 = sibling.lfs.sha256 if sibling.lfs else None
    etag = sha256 or sibling.blob_id
    size = sibling.lfs.size if sibling.lfs else sibling.size
    if etag is None:  # a listing without blob ids: ask about the file itself
        meta = get_hf_file_metadata(url)
        etag, size = meta.etag, meta.size
    blob = repo_dir / "blobs" / str(etag)
    if not blob.exists():
        _download_blob(url, blob, size, sha256, sibling.rfilename, progress)
    elif progress is not None:
        progress(sibling.rfilename, blob.stat().st_size, blob.stat().st_size)
    link = snapshot / sibling.rfilename
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)  # a dangling link
        link.symlink_to(os.path.relpath(blob, link.parent))


def _download_blob(
    url: str,
    blob: Path,
    size: int | None,
    sha256: str | None,
    label: str,
    progress: Progress | None = None,
) -> None:
    """GET ``url`` into ``blob``, resuming ``<blob>.incomplete`` with a Range request."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import (
        WeakFileLock,
        build_hf_headers,
        get_session,
        hf_raise_for_status,
    )
    from huggingface_hub.utils import tqdm as progress_bar

    blob.parent.mkdir(parents=True, exist_ok=True)
    partial = blob.with_name(blob.name + ".incomplete")
    with WeakFileLock(blob.with_name(blob.name + ".lock")):
        if blob.exists():  # another process finished it while this one waited
            return
        start = partial.stat().st_size if partial.exists() else 0
        if size is not None and start > size:
            start = 0
        headers = build_hf_headers() | {"Accept-Encoding": "identity"}
        if start:
            headers["Range"] = f"bytes={start}-"
        digest = _sha256(partial, start)  # of what is there; the rest is hashed as it comes
        bar = progress_bar(total=size, initial=start, unit="B", unit_scale=True, desc=label)
        with bar:
            try:
                with get_session().stream(
                    "GET",
                    url,
                    headers=headers,
                    timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                    follow_redirects=True,
                ) as response:
                    hf_raise_for_status(response)
                    if start and response.status_code != 206:  # the server ignored the Range
                        start = 0
                        digest = hashlib.sha256()
                        bar.reset(total=size)
                    num_done = start
                    with partial.open("ab" if start else "wb") as f:
                        for chunk in response.iter_bytes():
                            f.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
                            num_done += len(chunk)
                            if progress is not None:
                                progress(label, num_done, size)
            except HfHubHTTPError:
                raise
            except Exception as e:  # noqa: BLE001 -- the connection broke: keep what came
                done = partial.stat().st_size if partial.exists() else 0
                raise ValueError(
                    f"the download of {label} stopped at {done} of {size} bytes "
                    f"({_first_line(e)}); run the same command again to resume"
                ) from None
        done = partial.stat().st_size
        if size is not None and done != size:
            raise ValueError(
                f"the download of {label} stopped at {done} of {size} bytes; "
                f"run the same command again to resume"
            )
        if sha256 is not None and digest.hexdigest() != sha256:
            partial.unlink()
            raise ValueError(
                f"the download of {label} does not match the hub's sha256 and was removed; "
                f"run the same command again"
            )
        partial.replace(blob)


def _sha256(path: Path, num_bytes: int) -> hashlib._Hash:
    """A sha256 of the first ``num_bytes`` of ``path``, to be continued."""
    digest = hashlib.sha256()
    if num_bytes:
        with path.open("rb") as f:
            while num_bytes > 0 and (chunk := f.read(min(_CHUNK_BYTES, num_bytes))):
                digest.update(chunk)
                num_bytes -= len(chunk)
    return digest


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
