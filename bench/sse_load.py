"""A closed-loop SSE load generator that costs little CPU (bench/serve_capacity.py).

Each client holds one keep-alive HTTP/1.1 connection and sends the same streamed
chat-completions request again as soon as the last one ended. Raw asyncio protocols and
httptools's parser (what uvicorn uses), no HTTP client library: the generator shares the
machine with the server it measures, so its own cost is kept low and reported.

Driven over a pipe: "start" opens a measuring window, "stop" closes it and answers with
what the clients saw in it, "quit" ends the process.
"""

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import httptools


class Window:
    """What the clients saw while a window is open."""

    def __init__(self) -> None:
        self.open = False
        self.reset()

    def reset(self) -> None:
        self.started = time.monotonic()
        self.gaps: list[float] = []  # between text-carrying messages of one request
        self.chars = 0
        self.messages = 0
        self.requests = 0
        self.errors = 0


class SSEClient(asyncio.Protocol):
    """One connection; `request()` sends the request and resolves when its response ends."""

    def __init__(self, window: Window, loop: asyncio.AbstractEventLoop) -> None:
        self.window, self.loop = window, loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None
        self.buffer = b""
        self.last: float | None = None
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def request(self, payload: bytes) -> asyncio.Future:
        self.done = self.loop.create_future()
        self.buffer, self.last = b"", None
        self.transport.write(payload)
        return self.done

    # ---- httptools callbacks ------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.buffer += body
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            self.on_event(event)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(self.status)

    def on_event(self, event: bytes) -> None:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return
        chunk = json.loads(event[6:])
        if "error" in chunk:
            self.window.errors += self.window.open
            return
        choices = chunk["choices"]
        text = choices[0]["delta"].get("content") if choices else None
        if not text:
            return
        now = time.monotonic()
        window = self.window
        if window.open:
            window.messages += 1
            window.chars += len(text)
            if self.last is not None:
                window.gaps.append(now - self.last)
        self.last = now


async def client(host: str, port: int, payload: bytes, window: Window) -> None:
    loop = asyncio.get_running_loop()
    conn: SSEClient | None = None
    while True:
        try:
            if conn is None or conn.transport is None or conn.transport.is_closing():
                _, conn = await loop.create_connection(lambda: SSEClient(window, loop), host, port)
            status = await conn.request(payload)
            if status != 200:
                raise ConnectionError(f"HTTP {status}")
            window.requests += window.open
        except (ConnectionError, OSError) as exc:
            window.errors += window.open
            print(f"client: {exc!r}", flush=True)
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            conn = None
            await asyncio.sleep(0.5)


def run_load(
    url: str, body: dict[str, Any], clients: int, tokens_per_char: float, control: Any
) -> None:
    """The process's entry point: `clients` streams on `url`, windows driven by `control`.
    Tokens are counted as the text's characters times `tokens_per_char` (every request
    streams the same text)."""
    try:
        from uvloop import run  # what uvicorn runs on: the cheapest loop
    except ImportError:
        run = asyncio.run
    run(_main(url, body, clients, tokens_per_char, control))


async def _main(
    url: str, body: dict[str, Any], clients: int, tokens_per_char: float, control: Any
) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    data = json.dumps(body).encode()
    payload = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    window = Window()
    tasks = [asyncio.create_task(client(host, port, payload, window)) for _ in range(clients)]
    loop = asyncio.get_running_loop()
    quit_ = loop.create_future()

    def on_command() -> None:
        command = control.recv()
        if command == "start":
            window.reset()
            window.open = True
        elif command == "stop":
            window.open = False
            seconds = time.monotonic() - window.started
            gaps = sorted(window.gaps)
            control.send(
                {
                    "seconds": seconds,
                    "tokens": window.chars * tokens_per_char,
                    "gap_p50_s": gaps[len(gaps) // 2] if gaps else None,
                    "gap_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
                    "gaps": len(gaps),
                    "messages": window.messages,
                    "requests": window.requests,
                    "errors": window.errors,
                }
            )
        elif not quit_.done():
            quit_.set_result(None)

    loop.add_reader(control.fileno(), on_command)
    await quit_
    for task in tasks:
        task.cancel()
