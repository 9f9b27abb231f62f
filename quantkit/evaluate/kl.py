"""Next-token divergence of a candidate deployment from its baseline on held-out text.

Each held-out document is sent to both servers as a prompt with `echo` and `logprobs=k` (OpenAI
`/v1/completions`; SGLang's native `/generate` with `return_logprob`, `logprob_start_len=0` where its
completions endpoint lacks prompt logprobs). Per prompt position we get the top-k log-probabilities of each
side plus the log-probability of the actual token.

How the top-k truncation bounds the estimate: at each position the tokens whose probability is known on
BOTH sides (the intersection of the two top-k sets, plus the actual token, always returned) are kept as
single outcomes and every other token is merged into one "rest" outcome with probability 1 - (known mass)
on each side. The KL of these coarsened distributions is computed exactly, and by the data-processing
inequality it is a LOWER bound on the true KL(baseline || candidate); the gap is confined to the baseline
mass in "rest" (reported as `rest_mass`: when it is small, so is the gap). The top-1 flip rate (argmax of
baseline != argmax of candidate) is exact for any k >= 1, and so are the per-token NLLs of the text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.evaluate.client import Endpoint

__all__ = ["Api", "fetch_logprobs", "position_kl", "score_document", "DocScore"]

Api = Literal["openai", "sglang"]
TopK = dict[str, float]
EPS = 1e-12


def fetch_logprobs(ep: Endpoint, text: str, k: int, api: Api = "openai") -> JSONObject:
    """{"tokens": [str], "top": [TopK | None]} for the prompt positions of `text` (position 0 has no
    distribution). Each TopK holds the top-k tokens and the actual token."""
    if api == "sglang":
        return _fetch_sglang(ep, text, k)
    resp = ep.post("completions", {"prompt": text, "max_tokens": 1, "echo": True, "logprobs": k,
                                   "temperature": 0.0})
    choice = resp["choices"][0]
    lp = choice.get("logprobs") or {}
    tokens, token_lps, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    if not tokens or not tops or len(tokens) < 2:
        raise QuantkitError(f"{ep.url}: /v1/completions returned no prompt logprobs (echo=true, logprobs={k}): "
                            "this server cannot score kl on its completions endpoint (SGLang: --api sglang)")
    n = (resp.get("usage") or {}).get("prompt_tokens") or len(tokens) - 1
    top: list[TopK | None] = [None]
    for i in range(1, n):
        entry = dict(tops[i] or {})
        if token_lps[i] is not None:
            entry[tokens[i]] = float(token_lps[i])
        top.append({str(t): float(v) for t, v in entry.items()})
    return {"tokens": [str(t) for t in tokens[:n]], "top": top}


def _fetch_sglang(ep: Endpoint, text: str, k: int) -> JSONObject:
    url = ep.url
    resp = ep.post("/generate", {"text": text, "return_logprob": True, "logprob_start_len": 0,
                                       "top_logprobs_num": k, "sampling_params": {"max_new_tokens": 1,
                                                                                  "temperature": 0.0}})
    meta = resp.get("meta_info") or {}
    actual, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
    if not actual or not tops:
        raise QuantkitError(f"{url}: /generate returned no input logprobs (return_logprob, logprob_start_len=0)")
    top: list[TopK | None] = [None]
    for (lp, tok, _), cands in list(zip(actual, tops, strict=False))[1:]:
        entry = {str(t): float(v) for v, t, *_ in (cands or []) if v is not None}
        entry[str(tok)] = float(lp)
        top.append(entry)
    return {"tokens": [str(a[1]) for a in actual], "top": top}


def position_kl(p: TopK, q: TopK) -> tuple[float, float]:
    """(coarsened KL(p || q), baseline mass outside the shared outcomes) at one position."""
    shared = p.keys() & q.keys()
    kl, p_known, q_known = 0.0, 0.0, 0.0
    for t in shared:
        pt, qt = math.exp(p[t]), math.exp(q[t])
        p_known += pt
        q_known += qt
        kl += pt * (p[t] - q[t])
    p_rest, q_rest = max(0.0, 1.0 - p_known), max(EPS, 1.0 - q_known)
    if p_rest > EPS:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0), p_rest


@dataclass(frozen=True)
class DocScore:
    positions: int
    kl: float  # mean over positions (nats / token)
    flip: float  # fraction of positions whose argmax differs
    rest_mass: float  # mean baseline mass outside the shared outcomes
    nll_baseline: float
    nll_candidate: float


def score_document(base: JSONObject, cand: JSONObject, doc: str) -> DocScore:
    """Paired per-position scores of one document (both sides must have tokenized it identically)."""
    if base["tokens"] != cand["tokens"]:
        raise QuantkitError(f"kl: document {doc} tokenizes differently on the two servers "
                            "(different tokenizers: KL per token is undefined)")
    kl = flips = rest = nll_b = nll_c = 0.0
    n = 0
    for i in range(1, len(base["tokens"])):
        p, q, tok = base["top"][i], cand["top"][i], base["tokens"][i]
        d, r = position_kl(p, q)
        kl, rest, n = kl + d, rest + r, n + 1
        flips += max(p, key=p.__getitem__) != max(q, key=q.__getitem__)
        nll_b -= p[tok]
        nll_c -= q[tok]
    if n == 0:
        raise QuantkitError(f"kl: document {doc} is a single token")
    return DocScore(n, kl / n, flips / n, rest / n, nll_b / n, nll_c / n)
