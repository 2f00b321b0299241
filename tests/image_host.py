"""A local HTTP server of images, for the tests of image URLs: real sockets and real
HTTP, on 127.0.0.1 (a private address: the ingress fetches from it only when the config
lists it in `images.url_private_hosts`)."""

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _handler(files: dict[str, bytes]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._answer()  # else a client that gave up (the tests' time bounds)

        def _answer(self) -> None:
            if self.path.startswith("/redirect/"):  # /redirect/<url-less-scheme path>
                self.send_response(302)
                self.send_header("Location", self.path.removeprefix("/redirect"))
                self.end_headers()
            elif self.path == "/to-ftp":
                self.send_response(302)
                self.send_header("Location", "ftp://127.0.0.1/a.png")
                self.end_headers()
            elif self.path == "/slow":  # a trickle: each byte in time, the whole too slow
                self.send_response(200)
                self.end_headers()
                for _ in range(40):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            elif self.path == "/slow-headers":  # each header byte in time, the whole not
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Trickle: ")
                for _ in range(40):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
                self.wfile.write(b"\r\nContent-Length: 0\r\n\r\n")
            elif self.path == "/endless":  # no length: the bound is on what arrives
                self.send_response(200)
                self.end_headers()
                for _ in range(64):
                    self.wfile.write(b"\0" * 65536)
            elif self.path in files:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(files[self.path])))
                self.end_headers()
                self.wfile.write(files[self.path])
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

    return Handler


@contextlib.contextmanager
def image_host(files: dict[str, bytes]) -> Iterator[str]:
    """Serve `files` (path -> bytes) and yield the base URL (http://127.0.0.1:port)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(files))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
