"""A small local OpenAI-compatible HTTP server for the FAST tests of `quantkit eval --endpoint`.

Used only where a real engine cannot run in `make test` (the real-engine tests, slow-marked, serve with
vLLM: tests/eval/test_vllm_served.py). It answers the three calls quantkit makes — /v1/models,
/v1/completions with echo + logprobs (a character-level toy language model whose distribution at each
position is a seeded function of the previous character) and /v1/chat/completions with tools (answers the
bundled tool-call items correctly, or with schema-invalid arguments when `broken_tools`) — and counts
requests so tests can check that a resumed run does not ask again.
"""

from __future__ import annotations

import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

VOCAB = [chr(c) for c in range(32, 127)] + ["\n"]
TOOLCALL = Path(__file__).resolve().parents[2] / "calibration_data" / "toolcall.jsonl"


class ToyModel:
    def __init__(self, noise: float = 0.0, seed: int = 0) -> None:
        self.noise, self.seed = noise, seed

    def logprobs(self, prev: str) -> dict[str, float]:
        rng = random.Random(f"base:{prev}")
        logits = [3.0 * rng.random() ** 3 * 4 for _ in VOCAB]
        if self.noise:
            nrng = random.Random(f"noise:{self.seed}:{prev}")
            logits = [v + self.noise * nrng.gauss(0, 1) for v in logits]
        m = max(logits)
        z = m + math.log(sum(math.exp(v - m) for v in logits))
        return {t: v - z for t, v in zip(VOCAB, logits, strict=True)}


class FakeServer:
    def __init__(self, model: ToyModel, name: str = "toy", broken_tools: bool = False) -> None:
        self.model, self.name, self.broken_tools = model, name, broken_tools
        self.requests: dict[str, int] = {}
        items = [json.loads(x) for x in TOOLCALL.read_text().splitlines() if x.strip()]
        self.expected = {it["messages"][-1]["content"]: it["expected"] for it in items}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._send(200, {"data": [{"id": outer.name}]})

            def do_POST(self) -> None:  # noqa: N802
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests[self.path] = outer.requests.get(self.path, 0) + 1
                if self.path == "/v1/completions":
                    self._send(200, outer.completions(req))
                elif self.path == "/v1/chat/completions":
                    self._send(200, outer.chat(req))
                else:
                    self._send(404, {"error": self.path})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def completions(self, req: dict[str, Any]) -> dict[str, Any]:
        text, k = req["prompt"], int(req["logprobs"])
        tokens = [c if c in VOCAB else "?" for c in text]
        token_lps: list[float | None] = [None]
        tops: list[dict[str, float] | None] = [None]
        for i in range(1, len(tokens)):
            lp = self.model.logprobs(tokens[i - 1])
            token_lps.append(lp[tokens[i]])
            tops.append(dict(sorted(lp.items(), key=lambda kv: -kv[1])[:k]))
        lp = self.model.logprobs(tokens[-1])
        gen = max(lp, key=lp.__getitem__)  # the one generated token (max_tokens=1)
        return {"choices": [{"text": text + gen, "logprobs": {"tokens": tokens + [gen], "token_logprobs": token_lps +
                                                              [lp[gen]], "top_logprobs": tops + [None]}}],
                "usage": {"prompt_tokens": len(tokens)}}

    def chat(self, req: dict[str, Any]) -> dict[str, Any]:
        want = self.expected[req["messages"][-1]["content"]]
        args: Any = dict(want["arguments"]) or {"expression": "1+1"}
        if self.broken_tools:
            args = {"unexpected": True}
        call = {"id": "c0", "type": "function", "function": {"name": want["name"], "arguments": json.dumps(args)}}
        return {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}
