"""Calibration data: read records from JSONL / text / parquet / a hub dataset, render chats with the
model's chat template, tokenize, and cut a seeded sample of fixed-length token windows.

Every window has exactly `seq_len` tokens (documents are joined with the EOS token and cut), so a batch
needs no padding and every token counts in the Hessians — the same token budget llm-compressor would
spend on `samples x seq_len`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSON, JSONObject

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

__all__ = ["load_records", "render", "tokenize_windows", "calibration_tokens"]

Record = JSONObject  # one line of the calibration file: {"text": ...} or {"messages": [...]}


def load_records(spec: str | Path) -> list[Record]:
    """Records (`{"text": ...}` or `{"messages": [...]}`) from a file or, failing that, a hub dataset."""
    path = Path(spec)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            return _read_jsonl(path)
        if suffix == ".parquet":
            return _read_parquet(path)
        return _read_text(path)
    if path.exists():
        raise QuantkitError(f"{path}: calibration data must be a file (JSONL, text or parquet)")
    return _read_hub(str(spec))


def _check(record: JSON, where: str) -> Record:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return {"text": record["text"]}
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return {"messages": record["messages"]}
    raise QuantkitError(f"{where}: each record needs a 'text' string or a 'messages' list")


def _read_jsonl(path: Path) -> list[Record]:
    out = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuantkitError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            out.append(_check(value, f"{path}:{number}"))
    if not out:
        raise QuantkitError(f"{path}: no records")
    return out


def _read_text(path: Path) -> list[Record]:
    """Plain text: one record per blank-line separated block (a whole file may be one document)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise QuantkitError(f"{path}: not UTF-8 text (use JSONL, text or parquet)") from None
    blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
    if not blocks:
        raise QuantkitError(f"{path}: empty")
    return [{"text": b} for b in blocks]


def _read_parquet(path: Path) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise QuantkitError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path)
    column = "text" if "text" in table.column_names else "messages" if "messages" in table.column_names else None
    if column is None:
        raise QuantkitError(f"{path}: parquet needs a 'text' or 'messages' column")
    return [_check({column: v}, f"{path}") for v in table.column(column).to_pylist()]


def _read_hub(name: str) -> list[Record]:
    """A hub dataset `name` or `name:split`; only when the hub is reachable."""
    repo, _, split = name.partition(":")
    try:
        import datasets

        ds = datasets.load_dataset(repo, split=split or "train")
    except Exception as exc:  # offline, unknown name, gated: all the user's to fix
        raise QuantkitError(f"calibration data {name!r}: not a file, and not loadable from the hub ({exc})") from None
    column = "text" if "text" in ds.column_names else "messages"
    return [_check({column: row[column]}, name) for row in ds]


def render(record: Record, tokenizer: Tokenizer) -> str:
    """The text a record stands for: chats go through the model's own chat template."""
    if "text" in record:
        return record["text"]
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in record["messages"])


def tokenize_windows(records: list[Record], tokenizer: Tokenizer, seq_len: int, seed: int) -> torch.Tensor:
    """All `seq_len` windows of the seeded-shuffled, EOS-joined corpus: int64 `[windows, seq_len]`."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for i in order:
        ids += tokenizer(render(records[i], tokenizer), add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids.append(int(eos))
    n = len(ids) // seq_len
    if n == 0:
        raise QuantkitError(f"calibration data: {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def calibration_tokens(spec: str | Path, tokenizer: Tokenizer, samples: int, seq_len: int,
                       seed: int = 0) -> torch.Tensor:
    """`samples` windows of `seq_len` tokens. With too little data the corpus is reshuffled and reused
    (each pass with a new seed) rather than silently running on fewer tokens than asked for."""
    records = load_records(spec)
    parts, have, rnd = [], 0, 0
    while have < samples:
        windows = tokenize_windows(records, tokenizer, seq_len, seed + rnd)
        parts.append(windows)
        have += windows.shape[0]
        rnd += 1
    return torch.cat(parts)[:samples].clone()
