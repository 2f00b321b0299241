"""A local stand-in for the Hugging Face Hub (not a test module): the two routes
huggingface_hub uses to list a repo and fetch its files, over real HTTP on loopback.

- GET /api/models/<owner>/<name>[/revision/<rev>]: {"id", "sha", "siblings": [...]}
- GET|HEAD /<owner>/<name>/resolve/<rev>/<path>: the bytes, with Range support

`rate` slows file bodies to that many bytes a second (to cancel a download midway);
`redirects` maps a repo file to a URL the hub answers 302 with (the SSRF tests);
`tampered` maps a repo file to other bytes of the same size, served in place of the ones
the listing describes (its `lfs.sha256` for weights, its git `blobId` for the rest, as
the Hub lists them).
"""

import hashlib
import json
import re
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 64 * 1024


class FixtureHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.rate: float | None = None
        self.redirects: dict[tuple[str, str], str] = {}
        self.tampered: dict[tuple[str, str], bytes] = {}
        self.requests: list[str] = []
        self.ranges: list[tuple[str, int]] = []  # (path, first byte) of each ranged GET
        self.ignore_range = False  # answer 200 with the whole file, as some mirrors do
        self.url = ""

    def add_repo(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = files

    def add_directory(self, repo: str, directory: Path) -> None:
        self.add_repo(
            repo,
            {
                str(p.relative_to(directory)): p.read_bytes()
                for p in directory.rglob("*")
                if p.is_file()
            },
        )

    def sha(self, repo: str) -> str:
        digest = hashlib.sha1()
        for name, data in sorted(self.repos[repo].items()):
            digest.update(name.encode() + hashlib.sha1(data).digest())
        return digest.hexdigest()


LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")  # stored with Git LFS, as the Hub does


def _sibling(name: str, data: bytes) -> dict:
    """A file as the Hub's model info lists it with files_metadata: the git blob id of
    its content (for an LFS file, of its pointer; here of the content, unused then), and
    for an LFS file the content's sha256."""
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    entry = {"rfilename": name, "size": len(data), "blobId": blob}
    if name.endswith(LFS_SUFFIXES):
        sha256 = hashlib.sha256(data).hexdigest()
        entry["lfs"] = {"size": len(data), "sha256": sha256, "pointerSize": 134}
    return entry


def _handler(hub: FixtureHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _json(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, body: bool) -> None:
            hub.requests.append(self.path)
            path = self.path.split("?", 1)[0]
            m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?$", path)
            if m:
                repo = m.group(1)
                if repo not in hub.repos:
                    self._json(404, {"error": "Repository not found"})
                    return
                siblings = [_sibling(name, data) for name, data in sorted(hub.repos[repo].items())]
                self._json(200, {"id": repo, "sha": hub.sha(repo), "siblings": siblings})
                return
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if not m or m.group(1) not in hub.repos or m.group(3) not in hub.repos[m.group(1)]:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            repo, file = m.group(1), m.group(3)
            target = hub.redirects.get((repo, file))
            if target is not None:
                self.send_response(302)
                self.send_header("Location", target)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = hub.tampered.get((repo, file), hub.repos[repo][file])
            start = 0
            ranged = re.match(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if ranged and not hub.ignore_range:
                start = int(ranged.group(1))
                hub.ranges.append((file, start))
            else:
                ranged = None
            self.send_response(206 if ranged else 200)
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", hub.sha(repo))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if not body:
                return
            try:
                for i in range(start, len(data), CHUNK):
                    self.wfile.write(data[i : i + CHUNK])
                    if hub.rate:
                        time.sleep(CHUNK / hub.rate)
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


@contextmanager
def fixture_hub():
    hub = FixtureHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def save_tiny_chat_model(directory: Path) -> Path:
    """A random 2-layer Llama over the default model's own tokenizer (its vocabulary and
    chat template): about 13 MB of safetensors, loadable by the engine."""
    from app.models.source import resolve_model
    from app.text.tokenizer import load_tokenizer
    from tests.helpers import save_tiny_checkpoint

    tokenizer = load_tokenizer(resolve_model("default"))
    save_tiny_checkpoint(
        directory,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    tokenizer.save_pretrained(directory)
    return directory
