"""Offline lm-eval tasks over quantkit's bundled held-out corpus (calibration_data/heldout.jsonl).

lm-eval downloads its standard tasks (gsm8k, arc_challenge, mmlu) from the Hugging Face hub at run time,
which this machine cannot reach; lm-eval's custom-task YAML over local JSON files runs the same harness
code (request building, loglikelihood / generate_until, filters, metrics, per-sample logs) offline:

- `qk_heldout_mc` (multiple_choice, loglikelihood, like arc_challenge / mmlu): a held-out passage, and
  four continuations: the true one and three taken from other passages at the same offset; metric acc.
- `qk_heldout_next` (generate_until, like gsm8k): a held-out passage; exact match of the next word.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HELDOUT = Path(__file__).resolve().parents[2] / "calibration_data" / "heldout.jsonl"

MC_YAML = """task: qk_heldout_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_YAML = """task: qk_heldout_next
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  temperature: 0.0
filter_list:
  - name: first-word
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(\\\\S+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def write_tasks(out: Path, n: int = 40, context_chars: int = 240) -> Path:
    """Write both tasks' JSONL and YAML into `out` (pass it as --lm-eval-include); returns `out`."""
    texts = [r["text"] for r in map(json.loads, HELDOUT.read_text().splitlines()) if "text" in r]
    texts = [t for t in texts if len(t) > context_chars + 80]
    rng = random.Random(0)
    mc, gen = [], []
    for i, text in enumerate(texts[:n]):
        cut = text.rfind(" ", 0, context_chars)
        context, rest = text[:cut], text[cut:]
        others = [t[cut : cut + 40] for j, t in enumerate(texts) if j != i][:]
        rng.shuffle(others)
        choices = [rest[:40], *others[:3]]
        order = list(range(4))
        rng.shuffle(order)
        mc.append({"context": context, "choices": [choices[k] for k in order], "label": order.index(0)})
        gen.append({"context": context, "answer": rest.split()[0]})
    out.mkdir(parents=True, exist_ok=True)
    for name, rows, yaml in (("qk_heldout_mc", mc, MC_YAML), ("qk_heldout_next", gen, GEN_YAML)):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / f"{name}.yaml").write_text(yaml.format(data=data))
    return out
