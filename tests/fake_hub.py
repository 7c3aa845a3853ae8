"""A Hugging Face hub on 127.0.0.1, for tests: the few endpoints huggingface_hub and
mlxserve's downloader use, over files held in memory.

    GET  /api/models/OWNER/NAME[/revision/REV]      model info: sha, siblings (size, blobId, lfs)
    HEAD /OWNER/NAME/resolve/REV/FILE                X-Repo-Commit, ETag, Content-Length
    GET  /OWNER/NAME/resolve/REV/FILE                the bytes; "Range: bytes=N-" gives a 206

Every request is recorded (method, path, Range header, bytes sent). Misbehaviours, each for
the next GET of a file: ``cut_after`` stops after that many bytes, as a dropped connection
does; ``stall_after`` sends that many bytes and then waits for ``release``; and
``ignore_range`` (all files) answers a Range request with the whole file (a 200).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_SUFFIXES = (".safetensors", ".gguf")


@dataclass
class Served:
    method: str
    path: str
    range: str | None
    num_bytes: int


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    requests: list[Served] = field(default_factory=list)
    cut_after: dict[str, int] = field(default_factory=dict)  # file name -> bytes, once
    stall_after: dict[str, int] = field(default_factory=dict)  # file name -> bytes, once
    release: threading.Event = field(default_factory=threading.Event)
    ignore_range: bool = False
    url: str = ""

    def commit(self, repo_id: str) -> str:
        digest = hashlib.sha1(repo_id.encode())
        for name, data in sorted(self.repos[repo_id].items()):
            digest.update(name.encode() + hashlib.sha1(data).digest())
        return digest.hexdigest()

    def info(self, repo_id: str) -> dict:
        siblings = []
        for name, data in sorted(self.repos[repo_id].items()):
            entry = {"rfilename": name, "size": len(data), "blobId": _git_blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 130}
            siblings.append(entry)
        return {
            "id": repo_id,
            "modelId": repo_id,
            "sha": self.commit(repo_id),
            "siblings": siblings,
        }

    def gets_of(self, name: str) -> list[Served]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(f"/{name}")]


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


_INFO = re.compile(r"^/api/models/([^/]+/[^/?]+)(?:/revision/[^/?]+)?(?:\?.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _not_found(self, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            hub.requests.append(Served(self.command, self.path, None, 0))

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            if m := _INFO.match(self.path):
                if m[1] not in hub.repos:
                    return self._not_found("RepoNotFound")
                data = json.dumps(hub.info(m[1])).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                hub.requests.append(Served(self.command, self.path, None, len(data)))
                return None
            m = _RESOLVE.match(self.path)
            if not m or m[1] not in hub.repos:
                return self._not_found("RepoNotFound")
            files = hub.repos[m[1]]
            if m[2] not in files:
                return self._not_found("EntryNotFound")
            data = files[m[2]]
            start = 0
            ranged = self.headers.get("Range")
            if ranged and not hub.ignore_range and (r := re.match(r"bytes=(\d+)-$", ranged)):
                start = int(r[1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.commit(m[1]))
            etag = hashlib.sha256(data).hexdigest() if m[2].endswith(LFS_SUFFIXES) else None
            self.send_header("ETag", f'"{etag or _git_blob_id(data)}"')
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                hub.requests.append(Served(self.command, self.path, ranged, 0))
                return None
            chunk = data[start:]
            cut = hub.cut_after.pop(m[2], None)
            if cut is not None:  # drop the connection part way
                chunk = chunk[:cut]
                self.close_connection = True
            stall = hub.stall_after.pop(m[2], None)
            if stall is not None:  # send a part, then hang until released
                self.wfile.write(chunk[:stall])
                self.wfile.flush()
                hub.release.wait(60)
                hub.requests.append(Served(self.command, self.path, ranged, stall))
                self.close_connection = True
                return None
            self.wfile.write(chunk)
            self.wfile.flush()
            hub.requests.append(Served(self.command, self.path, ranged, len(chunk)))
            return None

    return Handler


@contextmanager
def serve_fake_hub(repos: dict[str, dict[str, bytes]]) -> Iterator[FakeHub]:
    """A :class:`FakeHub` serving ``repos`` ({repo id: {file name: bytes}}) until exit."""
    hub = FakeHub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
