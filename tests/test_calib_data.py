"""Calibration data: the shipped corpus, the loaders (JSONL / text / parquet), chat templates, seeded windows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.calibrate.data import calibration_tokens, load_records, render, tokenize_windows
from quantkit.core.errors import QuantkitError

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "calibration_data" / "default.jsonl"


class ByteTokenizer:
    """A minimal tokenizer (UTF-8 bytes) so the loader is tested without any model files."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [b + 1 for b in text.encode("utf-8")]}


def test_corpus_is_mixed_and_documented():
    records = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    genres = {r["genre"] for r in records}
    assert {"chat_tool", "code", "math", "long_doc", "prose_ko", "prose_zh", "prose_en"} <= genres
    text = CORPUS.read_text(encoding="utf-8")
    assert any("\uac00" <= ch <= "\ud7a3" for ch in text), "Korean text missing"
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text), "Chinese text missing"
    assert any("tool_calls" in r.get("messages", [{}])[2] for r in records if r["genre"] == "chat_tool")
    assert CORPUS.stat().st_size < 600_000
    readme = (REPO / "calibration_data" / "README.md").read_text(encoding="utf-8")
    assert "written for quantkit" in readme and "CC0" in readme


def test_jsonl_text_and_messages(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "hello"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n', encoding="utf-8")
    recs = load_records(p)
    assert recs == [{"text": "hello"}, {"messages": [{"role": "user", "content": "hi"}]}]
    assert render(recs[1], ByteTokenizer()) == "user: hi"


def test_bad_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"oops": 1}\n', encoding="utf-8")
    with pytest.raises(QuantkitError, match=r"bad.jsonl:2"):
        load_records(p)
    p.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(QuantkitError, match=r"bad.jsonl:2: not valid JSON"):
        load_records(p)


def test_plain_text_and_parquet(tmp_path):
    t = tmp_path / "c.txt"
    t.write_text("first block\nstill first\n\nsecond block\n", encoding="utf-8")
    assert [r["text"] for r in load_records(t)] == ["first block\nstill first", "second block"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    q = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["a b", "c d"]}), q)
    assert load_records(q) == [{"text": "a b"}, {"text": "c d"}]


def test_unreachable_hub_name_is_a_user_error(monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # fail fast instead of retrying the network
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(QuantkitError, match="not a file"):
        load_records("no-such-org/no-such-dataset-quantkit")


def test_windows_are_seeded_full_length_and_reused_when_short():
    tok = ByteTokenizer()
    a = calibration_tokens(CORPUS, tok, samples=6, seq_len=64, seed=1)
    b = calibration_tokens(CORPUS, tok, samples=6, seq_len=64, seed=1)
    c = calibration_tokens(CORPUS, tok, samples=6, seq_len=64, seed=2)
    assert a.shape == (6, 64) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)
    recs = [{"text": "abcdefgh"}] * 3  # 27 tokens with EOS: 3 windows of 8 per pass
    assert tokenize_windows(recs, tok, 8, 0).shape == (3, 8)


def test_chat_template_of_the_tiny_tokenizer_is_applied(tmp_path):
    from quantkit.calibrate.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}]}
    text = render(rec, tok)
    assert text.startswith("<|user|>hi\n<|assistant|>") and '"name": "f"' in text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|user|>") in ids
