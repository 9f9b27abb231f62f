"""llm-compressor `oneshot` GPTQ on the same model, samples, scheme and ignore list: the quality and speed
reference quantkit's calibrated path is measured against (tests and `bench/gptq_vs_llmcompressor.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.core.jsontypes import JSONObject

if TYPE_CHECKING:
    from quantkit.arch import Role

__all__ = ["oneshot_gptq", "ignore_list"]


def ignore_list(config: JSONObject, roles: set[Role]) -> list[str]:
    """The compressed-tensors ignore list that quantizes exactly `roles` (quantkit's adapter rules)."""
    from quantkit.arch import get_adapter

    return get_adapter(config).ignore_patterns(roles)


def oneshot_gptq(model_dir: Path, out_dir: Path, tokens: torch.Tensor, ignore: list[str], group_size: int = 32,
                 dampening_frac: float = 0.01, block_size: int = 128, actorder: str | None = "static") -> None:
    """Run llm-compressor GPTQ W4A16 (symmetric, group `group_size`) on pre-tokenized windows `tokens`."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                                 actorder=actorder),
    )
    data = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    modifier = GPTQModifier(config_groups={"group_0": scheme}, ignore=ignore, dampening_frac=dampening_frac,
                            block_size=block_size)
    oneshot(model=model, dataset=data, recipe=[modifier], num_calibration_samples=tokens.shape[0],
            max_seq_length=tokens.shape[1], shuffle_calibration_samples=False, output_dir=str(out_dir))
    for p in Path(model_dir).glob("tokenizer*"):
        target = Path(out_dir) / p.name
        if not target.exists():
            target.write_bytes(p.read_bytes())
