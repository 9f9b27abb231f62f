"""Tiny *trained* reference models, so quantization quality is measurable on a laptop.

`build_tiny(arch)` trains a ~2M-parameter `deepseek_v3` (MLA, MoE in every layer), `glm_moe_dsa`
(MLA + DSA indexer, one dense layer then MoE) or `glm4_moe` (GQA attention, one dense layer then MoE)
on quantkit's calibration corpus with a small byte-level BPE tokenizer built here, deterministically, in
well under two minutes on 2 CPU cores, and saves it with `save_pretrained` (bf16, per-expert tensor names
on disk — the layout of real releases).

Results are cached under `.cache/quantkit/tiny/<arch>-<digest>/`; the digest covers this file and the
corpus, the schedule and the model config (and `TRAINING_VERSION`), so changing any retrains. Nothing
trained is committed: the script is the artefact.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.core.locations import CACHE_DIR, CALIBRATION_DATA

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["ARCHS", "CORPUS", "HELDOUT", "build_tiny", "build_tokenizer", "tiny_config", "cache_root"]

CORPUS = CALIBRATION_DATA / "default.jsonl"
HELDOUT = CALIBRATION_DATA / "heldout.jsonl"
ARCHS = ("deepseek_v3", "glm_moe_dsa", "glm4_moe")
VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% else %}{{ m['content'] }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Training schedule: about a minute of CPU, long enough that experts specialise. One thread: these ops
# are too small to gain from two, and two threads thrash badly when other processes share the cores.
STEPS, BATCH, SEQ, LR = 150, 8, 128, 3e-3


def cache_root() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", CACHE_DIR / "quantkit"))


# Bump when the training code changes in a way that changes the weights (cosmetic edits need not).
TRAINING_VERSION = 1


def _digest(arch: str) -> str:
    """Cache key: corpus bytes, schedule, model config and TRAINING_VERSION."""
    h = hashlib.sha256(CORPUS.read_bytes())
    h.update(repr((TRAINING_VERSION, STEPS, BATCH, SEQ, LR, VOCAB, SPECIALS, CHAT_TEMPLATE)).encode())
    h.update(tiny_config(arch).to_json_string().encode())
    return h.hexdigest()[:12]


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (512 tokens) trained on the corpus, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from quantkit.calibrate.data import load_records

    texts = []
    for rec in load_records(CORPUS):
        texts.append(rec["text"] if "text" in rec else "\n".join(str(m.get("content")) for m in rec["messages"]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def tiny_config(arch: str) -> PretrainedConfig:
    """The transformers config of a tiny model (all quantized dims multiples of 32)."""
    from transformers import AutoConfig

    common: dict[str, int | float | bool] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=0,
    )
    if arch == "deepseek_v3":
        return AutoConfig.for_model(
            "deepseek_v3", num_hidden_layers=4, first_k_dense_replace=0, num_nextn_predict_layers=0, **common
        )
    if arch == "glm_moe_dsa":
        return AutoConfig.for_model(
            "glm_moe_dsa",
            num_hidden_layers=4,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            indexer_types=["full"] * 4,  # "shared" layers omit indexer weights (see docs/calibration.md)
            first_k_dense_replace=1,
            index_n_heads=2,
            index_head_dim=32,
            index_topk=64,
            num_nextn_predict_layers=0,
            **common,
        )
    if arch == "glm4_moe":  # standard attention (GQA): what vLLM's CPU build runs consistently (docs/eval.md)
        keep = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
                "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
                "routed_scaling_factor", "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
                "pad_token_id", "bos_token_id")
        return AutoConfig.for_model("glm4_moe", num_hidden_layers=4, num_key_value_heads=2, head_dim=32,
                                    use_qk_norm=True, attention_bias=True, first_k_dense_replace=1, num_mtp_layers=0,
                                    **{k: common[k] for k in keep})
    raise ValueError(f"unknown tiny arch {arch!r} (choose from {ARCHS})")


def _balance_hooks(model: PreTrainedModel) -> tuple[list[RemovableHandle], dict[int, torch.Tensor]]:
    """Count per-router expert loads each step (DeepSeek's aux-loss-free balancing needs them)."""
    loads: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue

        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...],
                 i: int = i) -> None:
            loads[i] = torch.bincount(out[2].flatten(), minlength=module.num_experts).float()

        handles.append(gate.register_forward_hook(hook))
    return handles, loads


def train(arch: str, out_dir: Path, log: Callable[[str], None] = print) -> dict[str, str | int | float]:
    """Train a tiny model into `out_dir` (tokenizer included); returns training stats."""
    from transformers import AutoModelForCausalLM

    from quantkit.calibrate.data import calibration_tokens

    torch.manual_seed(0)
    tokenizer = build_tokenizer(out_dir)
    windows = calibration_tokens(CORPUS, tokenizer, samples=STEPS * BATCH, seq_len=SEQ, seed=1)
    config = tiny_config(arch)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
    handles, loads = _balance_hooks(model)
    start, losses = time.time(), []
    for step in range(STEPS):
        lr = LR * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = windows[step * BATCH : (step + 1) * BATCH]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing: nudge under-used experts up
            for i, load in loads.items():
                gate = model.model.layers[i].mlp.gate
                gate.e_score_correction_bias += 1e-3 * torch.sign(load.mean() - load)
        losses.append(loss.item())
        if step % 50 == 0 or step == STEPS - 1:
            log(f"  {arch} step {step:4d} loss {losses[-1]:.3f} ({time.time() - start:.0f}s)")
    for h in handles:
        h.remove()
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out_dir)
    stats = {"arch": arch, "steps": STEPS, "final_loss": sum(losses[-20:]) / 20, "seconds": time.time() - start}
    (out_dir / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def build_tiny(arch: str, root: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Path of the trained tiny `arch` model, training it first if the cache lacks it."""
    target = (root or cache_root() / "tiny") / f"{arch}-{_digest(arch)}"
    if (target / "training.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=target.parent))
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        train(arch, tmp, log)
        torch.set_num_threads(threads)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    import sys

    for a in sys.argv[1:] or ARCHS:
        print(build_tiny(a))
