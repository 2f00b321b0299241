"""Load test: OpenAI (chat and completions) and Ollama users streaming from a Shoal server.

    locust -f loadtests/locustfile.py --headless -u 32 -r 8 -t 2m --host http://127.0.0.1:8000

Besides each HTTP request, every finished stream records three locust metrics, so they
show in the same table (their "response time" column holds the value):
  TTFT <name>       milliseconds from sending the request to the first text
  ITL <name>        milliseconds between tokens after the first, averaged over the stream
  tok/s <name>      the stream's output tokens per second after its first token
A stream that ends without its final message, or with an error event, is a failure.

Environment: SHOAL_MODEL (default smollm2-135m-instruct), SHOAL_API_KEY,
SHOAL_MAX_TOKENS (comma-separated output lengths to mix, default 16,64,128).
"""

import json
import os
import random
import time

from locust import HttpUser, between, events, task

MODEL = os.environ.get("SHOAL_MODEL", "smollm2-135m-instruct")
API_KEY = os.environ.get("SHOAL_API_KEY", "")
OUTPUT_LENGTHS = [int(n) for n in os.environ.get("SHOAL_MAX_TOKENS", "16,64,128").split(",")]

SHORT = ["Hi!", "Name a colour.", "What is 2 + 2?"]
MEDIUM = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper and the sea at night.",
    "List three things to check before a long bicycle ride, with a reason for each.",
]
LONG = [
    "Here are some notes from a meeting. "
    + "The team discussed the release schedule, the open bugs and the budget. " * 12
    + "Summarise the notes in one paragraph.",
    "Read this story and say what happens next. "
    + "A fox walked through the snowy forest looking for food, listening for mice. " * 10,
]


def prompt() -> str:
    return random.choice(random.choice([SHORT, MEDIUM, LONG]))


def record(kind: str, name: str, value: float, length: int = 0) -> None:
    events.request.fire(
        request_type=kind,
        name=name,
        response_time=value,
        response_length=length,
        exception=None,
        context={},
    )


class StreamTimer:
    """TTFT, inter-token latency and tokens/s of one stream."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def text(self, chunk: str) -> None:
        if chunk and self.first is None:
            self.first = time.perf_counter()

    def report(self, name: str, tokens: int) -> None:
        if self.first is None:
            return
        end = time.perf_counter()
        record("TTFT", name, 1000 * (self.first - self.start), tokens)
        if tokens > 1 and end > self.first:
            record("ITL", name, 1000 * (end - self.first) / (tokens - 1), tokens)
            record("tok/s", name, (tokens - 1) / (end - self.first), tokens)


class ShoalUser(HttpUser):
    abstract = True
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"


class OpenAIChatUser(ShoalUser):
    weight = 2

    @task
    def chat(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt()}],
            "max_tokens": random.choice(OUTPUT_LENGTHS),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._sse("/v1/chat/completions", body, "chat", lambda c: c["delta"].get("content"))

    def _sse(self, path: str, body: dict, name: str, text_of) -> None:
        timer = StreamTimer()
        with self.client.post(
            path, json=body, stream=True, catch_response=True, name=name
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            tokens, done = 0, False
            for line in response.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    response.failure(f"error event: {event['error'].get('message')}")
                    return
                for choice in event.get("choices", []):
                    timer.text(text_of(choice) or "")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            if not done:
                response.failure("the stream ended without [DONE]")
                return
            response.success()
            timer.report(name, tokens)


class OpenAICompletionUser(OpenAIChatUser):
    weight = 1

    @task
    def chat(self) -> None:  # replaces the chat task: this user sends completions
        body = {
            "model": MODEL,
            "prompt": prompt(),
            "max_tokens": random.choice(OUTPUT_LENGTHS),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._sse("/v1/completions", body, "completions", lambda c: c.get("text"))


class OllamaUser(ShoalUser):
    weight = 1

    @task
    def chat(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt()}],
            "options": {"num_predict": random.choice(OUTPUT_LENGTHS)},
            "stream": True,
        }
        timer = StreamTimer()
        with self.client.post(
            "/api/chat", json=body, stream=True, catch_response=True, name="ollama chat"
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            for line in response.iter_lines(decode_unicode=True):
                if not line:
                    continue
                event = json.loads(line)
                if "error" in event:
                    response.failure(f"error: {event['error']}")
                    return
                timer.text(event.get("message", {}).get("content", ""))
                if event.get("done"):
                    response.success()
                    timer.report("ollama chat", event.get("eval_count", 0))
                    return
            response.failure("the stream ended without a done message")
