"""`quantkit eval --endpoint`: scoring math and the client/CLI against a local fake server (fast).

The fake (tests/eval/fake_openai.py) is used only because a real engine cannot run in `make test`; the
same client is tested against a real vLLM server in tests/eval/test_vllm_served.py (slow).
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.evaluate import toolcall
from quantkit.evaluate.kl import position_kl
from quantkit.evaluate.lmeval import item_scores
from quantkit.evaluate.stats import bootstrap_ci, compare
from quantkit.evaluate.store import AnswerStore

sys.path.insert(0, str(Path(__file__).parent / "eval"))
from fake_openai import FakeServer, ToyModel  # noqa: E402

TOOLCALL = Path(__file__).resolve().parents[1] / "calibration_data" / "toolcall.jsonl"


def _dist(rng: random.Random, n: int, temp: float) -> dict[str, float]:
    logits = [rng.gauss(0, temp) for _ in range(n)]
    z = math.log(sum(math.exp(v) for v in logits))
    return {str(i): v - z for i, v in enumerate(logits)}


def _exact_kl(p: dict[str, float], q: dict[str, float]) -> float:
    return sum(math.exp(p[t]) * (p[t] - q[t]) for t in p)


def _top(d: dict[str, float], k: int, actual: str) -> dict[str, float]:
    top = dict(sorted(d.items(), key=lambda kv: -kv[1])[:k])
    top[actual] = d[actual]
    return top


def test_kl_full_vocab_is_exact_and_truncation_is_a_lower_bound() -> None:
    rng = random.Random(0)
    for _ in range(50):
        p, q = _dist(rng, 40, 2.0), _dist(rng, 40, 2.0)
        exact = _exact_kl(p, q)
        assert position_kl(p, q)[0] == pytest.approx(exact, rel=1e-9, abs=1e-12)
        for k in (1, 3, 10):
            est, rest = position_kl(_top(p, k, "0"), _top(q, k, "0"))
            assert 0.0 <= est <= exact + 1e-12
            assert 0.0 <= rest <= 1.0
        assert position_kl(p, p)[0] == pytest.approx(0.0, abs=1e-12)


def test_bootstrap_ci_is_seeded_and_covers_the_mean() -> None:
    rng = random.Random(1)
    values = [rng.gauss(0.5, 1.0) for _ in range(200)]
    a, b = bootstrap_ci(values), bootstrap_ci(values)
    assert a == b
    assert a.low < a.mean < a.high
    wide = bootstrap_ci(values[:20])
    assert (wide.high - wide.low) > (a.high - a.low)
    assert bootstrap_ci([1.0] * 10).low == bootstrap_ci([1.0] * 10).high == 1.0


def test_verdict_threshold_in_points() -> None:
    base = [1.0] * 100
    cand = [1.0] * 99 + [0.0]  # -1 point, one item: below the bar but within noise
    assert compare("acc", cand, base, threshold=0.8).verdict == "inconclusive"
    many = [1.0] * 90 + [0.0] * 10  # -10 points over many items: a real regression
    assert compare("acc", many, base, threshold=0.8).verdict == "fail"
    assert compare("acc", many, base, threshold=12).verdict == "pass"
    assert compare("acc", cand, base, threshold=1.5).verdict == "pass"
    assert compare("acc", cand, base, threshold=0.8, gate=False).verdict == "pass"
    c = compare("acc", cand, base, threshold=0.8)
    assert c.diff is not None and c.diff.mean == pytest.approx(-1.0)
    assert compare("acc", cand, None, threshold=0.8).verdict == "unpaired"
    with pytest.raises(ValueError):
        compare("acc", cand, base[:5], threshold=0.8)


def test_toolcall_scoring() -> None:
    item = toolcall.load_items(TOOLCALL)[2]  # convert_currency 250 USD -> EUR
    exp = item["expected"]

    def call(name: str, args: object) -> dict[str, object]:
        return {"calls": [{"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}]}

    assert toolcall.score(item, call(exp["name"], exp["arguments"])) == {"called": 1.0, "valid": 1.0, "match": 1.0}
    wrong_value = dict(exp["arguments"], amount=25)
    assert toolcall.score(item, call(exp["name"], wrong_value)) == {"called": 1.0, "valid": 1.0, "match": 0.0}
    bad_schema = dict(exp["arguments"], from_currency="dollars")  # violates ^[A-Z]{3}$
    assert toolcall.score(item, call(exp["name"], bad_schema))["valid"] == 0.0
    assert toolcall.score(item, call(exp["name"], "{not json"))["valid"] == 0.0
    assert toolcall.score(item, call("no_such_tool", exp["arguments"]))["valid"] == 0.0
    assert toolcall.score(item, {"calls": [], "content": "hi"}) == {"called": 0.0, "valid": 0.0, "match": 0.0}


def test_store_resumes_and_ignores_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "answers.jsonl"
    s = AnswerStore(path)
    s.put("kl", "candidate", "doc0", {"x": 1})
    s.close()
    with path.open("a") as fh:
        fh.write('{"task": "kl", "side": "cand')  # killed mid-write
    s = AnswerStore(path)
    assert s.get("kl", "candidate", "doc0") == {"x": 1}
    assert s.get("kl", "candidate", "doc1") is None
    s.close()


def test_lm_eval_samples_parsing(tmp_path: Path) -> None:
    out = tmp_path / "out" / "model"
    out.mkdir(parents=True)
    rows = [{"doc_id": i, "filter": f, "exact_match": float(i % 2 == 0 or f == "flexible")}
            for i in range(4) for f in ("strict", "flexible")]
    (out / "samples_gsm8k_2026.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert item_scores(tmp_path / "out", "gsm8k") == {"gsm8k/0": 1.0, "gsm8k/1": 0.0, "gsm8k/2": 1.0, "gsm8k/3": 0.0}


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(noise: float = 0.0, broken_tools: bool = False) -> FakeServer:
        made.append(FakeServer(ToyModel(noise), broken_tools=broken_tools))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _eval(args: list[str]) -> tuple[int, dict]:
    res = CliRunner().invoke(app, ["eval", *args, "--json"])
    out = res.stdout.strip()
    return res.exit_code, json.loads(out[out.index("{"):]) if "{" in out else {}


def test_cli_pass_fail_record_and_resume(servers, tmp_path: Path) -> None:
    base, same, bad = servers(), servers(), servers(noise=3.0, broken_tools=True)
    common = ["--tasks", "kl,toolcall", "--limit", "6", "--state", str(tmp_path / "state"), "--concurrency", "2"]
    code, res = _eval(["--endpoint", same.url, "--baseline", base.url, *common])
    assert code == 0, res
    assert res["verdict"] == "pass"
    assert res["tasks"]["kl"]["kl_mean"] == pytest.approx(0.0, abs=1e-9)
    assert res["tasks"]["kl"]["flip_points"] == 0.0
    assert {c["metric"]: c["candidate"] for c in res["tasks"]["toolcall"]["comparisons"]} == {
        "called": 100.0, "valid": 100.0, "match": 100.0}
    answers = Path(res["answers"]).read_text().splitlines()
    assert len(answers) == 2 * (6 + 6)  # per-item answers kept, both sides

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "quantkit.json").write_text(json.dumps({"format": "test"}))
    code, res = _eval(["--endpoint", bad.url, "--baseline", base.url, *common, "--record", str(ckpt)])
    assert code == 1
    assert res["verdict"] == "fail"
    assert res["tasks"]["kl"]["verdict"] == "fail" and res["tasks"]["kl"]["kl_mean"] > 0.05
    valid = next(c for c in res["tasks"]["toolcall"]["comparisons"] if c["metric"] == "valid")
    assert valid["candidate"] == 0.0 and valid["verdict"] == "fail" and valid["diff"]["mean"] == -100.0
    recorded = json.loads((ckpt / "quantkit.json").read_text())
    assert recorded["format"] == "test" and recorded["eval"]["verdict"] == "fail"

    from quantkit.evaluate.report import format_text, html_section, markdown

    assert "| kl | top-1 flip" in markdown(recorded["eval"])
    assert "<h2 id='eval'>Served evaluation: fail</h2>" in html_section(recorded["eval"])
    assert "verdict: FAIL" in format_text(res)

    before = dict(bad.requests)  # a rerun resumes from the kept answers: no new requests
    code, again = _eval(["--endpoint", bad.url, "--baseline", base.url, *common])
    assert code == 1 and bad.requests == before
    assert again["tasks"]["kl"]["kl_mean"] == res["tasks"]["kl"]["kl_mean"]


def test_cli_errors_are_one_line(servers, tmp_path: Path) -> None:
    import subprocess

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "quantkit", "eval", *args, "--state", str(tmp_path)],
                              capture_output=True, text=True)

    proc = run("--endpoint", "http://127.0.0.1:9")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "/v1/models" in proc.stderr
    proc = run("--endpoint", servers().url, "--tasks", "kl")
    assert proc.returncode == 2 and "needs --baseline" in proc.stderr


def test_lm_eval_command_sets_generation_limits(tmp_path: Path) -> None:
    from quantkit.evaluate.client import Endpoint
    from quantkit.evaluate.lmeval import LmEvalOptions, command

    ep = Endpoint("http://h:1", "m")
    cmd = command(ep, "gsm8k", LmEvalOptions(python=Path("py"), max_length=4096, max_gen_toks=3000, limit=5),
                  tmp_path / "o", tmp_path / "c")
    args = cmd[cmd.index("--model_args") + 1].split(",")
    assert cmd[cmd.index("--model") + 1] == "local-completions"
    assert {"base_url=http://h:1/v1/completions", "max_length=4096", "max_gen_toks=3000"} <= set(args)
    assert cmd[cmd.index("--gen_kwargs") + 1] == "max_gen_toks=3000"  # over the task's own limit too
    assert "--log_samples" in cmd and "--use_cache" in cmd and cmd[cmd.index("--limit") + 1] == "5"
    sg = command(ep, "mmlu", LmEvalOptions(python=Path("py"), model="sglang-generate"), tmp_path, tmp_path)
    assert "base_url=http://h:1/generate" in sg[sg.index("--model_args") + 1]
