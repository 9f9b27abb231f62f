"""A minimal client for OpenAI-compatible servers (SGLang, vLLM): JSON over HTTP with the standard library."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

__all__ = ["Endpoint", "open_endpoint"]


@dataclass(frozen=True)
class Endpoint:
    """One served deployment: its base URL (…/v1 stripped) and the model name it serves."""

    url: str
    model: str
    timeout: float = 600.0
    retries: int = 3

    def post(self, path: str, payload: JSONObject) -> JSONObject:
        """POST `payload` (model filled in) to `path` under /v1 (or from the root if it starts with "/");
        retries transient failures (5xx, connection)."""
        target = f"{self.url}{path}" if path.startswith("/") else f"{self.url}/v1/{path}"
        body = json.dumps({"model": self.model, **payload}).encode()
        last = ""
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(target, data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:300]
                if exc.code < 500:
                    raise QuantkitError(f"{target}: HTTP {exc.code}: {detail}") from None
                last = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                last = str(exc)
            time.sleep(min(2.0**attempt, 10.0))
        raise QuantkitError(f"{target}: {last}")


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def open_endpoint(url: str, model: str | None = None, timeout: float = 600.0) -> Endpoint:
    """The endpoint at `url`; the served model name from /v1/models unless given."""
    base = _base(url)
    if model:
        return Endpoint(base, model, timeout)
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as resp:
            models = json.loads(resp.read()).get("data") or []
    except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError) as exc:
        raise QuantkitError(f"{base}/v1/models: cannot list the served model ({exc})") from None
    if not models:
        raise QuantkitError(f"{base}/v1/models: the server lists no model")
    return Endpoint(base, str(models[0]["id"]), timeout)
