"""A stand-in for ``llama-server`` on 127.0.0.1: ``/health`` (503 for the first few polls,
as while a model loads), ``/tokenize`` and a streamed or plain ``/completion`` whose greedy
tokens are ``prompt[-1] + 1, + 2, ...`` (``missing_tokens`` fewer than asked) and whose
``cache_n`` is the prompt's common prefix with the previous prompt. Like the real server, a
stream never sends the id of a token that ends inside a UTF-8 character (here: multiples of
``HELD``); its text goes with the next event. ``python fake_llama_server.py --port N`` serves
until killed."""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HELD = 50


def next_tokens(prompt: list[int], count: int) -> list[int]:
    return [prompt[-1] + k for k in range(1, count + 1)]


class FakeState:
    def __init__(self, loading_polls: int = 2) -> None:
        self.loading_polls = loading_polls
        self.missing_tokens = 0  # send this many tokens fewer than asked
        self.lock = threading.Lock()
        self.previous: list[int] = []
        self.received: list[tuple[float, list[int]]] = []
        self.finished: list[tuple[float, list[int]]] = []


def make_handler(state: FakeState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._json(404, {"error": {"code": 404, "message": "not found"}})
            with state.lock:
                loading = state.loading_polls > 0
                state.loading_polls -= 1
            if loading:
                return self._json(503, {"error": {"code": 503, "message": "Loading model"}})
            return self._json(200, {"status": "ok"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                return self._json(200, {"tokens": [1, *(ord(c) for c in body["content"])]})
            if self.path != "/completion":
                return self._json(404, {"error": {"code": 404, "message": "not found"}})
            prompt = [int(t) for t in body["prompt"]]
            with state.lock:
                state.received.append((time.monotonic(), prompt))
                cache_n = _common_prefix(prompt, state.previous)
                state.previous = prompt
            tokens = next_tokens(prompt, max(body["n_predict"] - state.missing_tokens, 0))
            timings = {"cache_n": cache_n, "prompt_n": len(prompt) - cache_n}
            if not body.get("stream"):
                self._json(200, {"tokens": tokens, "stop": True, "timings": timings})
            else:
                self._stream(tokens, timings)
            with state.lock:
                state.finished.append((time.monotonic(), prompt))

        def _stream(self, tokens: list[int], timings: dict[str, int]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = [
                {"tokens": [t], "stop": False, "tokens_predicted": n}
                for n, t in enumerate(tokens, 1)
                if t % HELD
            ]
            final = {"tokens": [], "stop": True, "timings": timings}
            events.append({**final, "tokens_predicted": len(tokens)})
            for event in events:
                time.sleep(0.002)
                self._chunk(f"data: {json.dumps(event)}\n\n".encode())
            self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def serve(port: int, state: FakeState) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(state))
    server.daemon_threads = True
    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    serve(parser.parse_args().port, FakeState()).serve_forever()
