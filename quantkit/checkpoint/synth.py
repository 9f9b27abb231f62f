"""Generating small checkpoints with the real tensor names, in the real source formats.

Used by `quantkit demo`, the tests and the benchmarks (nothing is downloaded). Tensor names and shapes
come from the architecture adapter's inventory (a test checks it against transformers' own models),
values from a seeded generator per tensor, so any size can be generated deterministically and shard by
shard without holding the model in memory. Formats: `bf16`, `fp8` (DeepSeek-style 128x128 blocks,
scale possibly in another shard) and `int4` (Kimi K2-style compressed-tensors routed experts).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from quantkit.arch import FAMILIES as arch_families
from quantkit.arch import Role, TensorSpec, get_adapter
from quantkit.checkpoint.qconfig import build_quantization_config
from quantkit.checkpoint.writer import PlannedTensor, StreamingShardWriter
from quantkit.core.jsontypes import JSON, JSONObject
from quantkit.core.locations import PLAN_CONFIGS
from quantkit.quant.int4 import pack_int4, quantize_rtn

__all__ = ["FAMILIES", "SIZES", "tiny_config", "make_checkpoint", "wrap_multimodal", "FP8_ROLES",
           "KIMI_PROCESSOR_FILES", "write_kimi_processor_files"]

FAMILIES = tuple(arch_families)
# Roles a DeepSeek/GLM FP8 release stores as FP8 blocks (embeddings, lm_head, norms, routers, indexer: not).
FP8_ROLES = {Role.ATTENTION, Role.DENSE_MLP, Role.SHARED_EXPERT, Role.ROUTED_EXPERT}
_COMMON = dict(first_k_dense_replace=1, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
               norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
               max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="bfloat16")
# (hidden, intermediate, moe_intermediate, layers, experts, heads, vocab) per size
SIZES = {
    "tiny": (64, 128, 64, 3, 8, 4, 256),
    "small": (256, 512, 128, 4, 16, 4, 1024),
    "bench": (1024, 2048, 512, 6, 32, 8, 8192),
}


def tiny_config(family: str, size: str = "tiny", **overrides: JSON) -> JSONObject:
    """A transformers-loadable config.json dict for `family`, scaled to `size`."""
    from transformers import AutoConfig

    hidden, inter, moe_inter, layers, experts, heads, vocab = SIZES[size]
    kw: JSONObject = dict(_COMMON, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=moe_inter,
                              num_hidden_layers=layers, n_routed_experts=experts, num_attention_heads=heads,
                              vocab_size=vocab)
    record = arch_families[family]
    kw.update(record.synth(hidden, heads, overrides))
    kw.update(overrides)
    config = AutoConfig.for_model(family, **kw).to_dict()
    config["architectures"] = [record.architecture]
    config.pop("transformers_version", None)
    return config


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def logical_value(spec: TensorSpec, seed: int) -> torch.Tensor:
    """A deterministic, plausible fp32 value for one tensor (norms near 1, biases near 0)."""
    gen = _generator(seed, spec.name)
    if spec.name.endswith("e_score_correction_bias") or spec.name.endswith(".bias"):
        return torch.randn(spec.shape, generator=gen) * 0.01
    if spec.role == Role.NORM or "norm" in spec.name.rsplit(".", 2)[-2]:
        return 1.0 + 0.05 * torch.randn(spec.shape, generator=gen)
    fan_in = spec.shape[-1] if len(spec.shape) == 2 else 1
    std = 1.0 if spec.role == Role.EMBEDDING else fan_in**-0.5
    value = torch.randn(spec.shape, generator=gen) * std
    if len(spec.shape) == 2 and spec.role == Role.ROUTED_EXPERT:  # a few outliers, as real weights have
        mask = torch.rand(spec.shape, generator=gen) < 0.002
        value = torch.where(mask, value * 8, value)
    return value


def _fp8_block(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale_inv per block) with absmax/448 block scales."""
    rows, cols = weight.shape
    pad = torch.nn.functional.pad(weight, (0, -cols % block, 0, -rows % block))
    blocks = pad.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [R, b, C, b]
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (weight / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale.float()


def _physical(spec: TensorSpec, fmt: str, seed: int, group_size: int) -> dict[str, torch.Tensor]:
    """The stored tensors for one logical tensor in the chosen source format."""
    value = logical_value(spec, seed)
    is_linear = spec.name.endswith(".weight") and len(spec.shape) == 2
    if fmt == "fp8" and is_linear and spec.role in FP8_ROLES:
        w, scale_inv = _fp8_block(value)
        return {spec.name: w, spec.name + "_scale_inv": scale_inv}
    if fmt == "int4" and is_linear and spec.role == Role.ROUTED_EXPERT:
        q, scale = quantize_rtn(value, group_size, torch.bfloat16)
        return pack_int4(q, scale).tensors(spec.name.removesuffix(".weight"))
    if spec.name.endswith("e_score_correction_bias"):
        return {spec.name: value.float()}  # fp32 in the releases
    return {spec.name: value.to(torch.bfloat16)}


def make_checkpoint(
    out_dir: str | Path,
    family: str = "glm_moe_dsa",
    fmt: str = "fp8",
    size: str = "tiny",
    seed: int = 0,
    shards: int = 3,
    mtp: bool = True,
    group_size: int = 32,
    extra_files: bool = True,
    config_overrides: JSONObject | None = None,
) -> Path:
    """Write a checkpoint directory: config.json, shards, index, tokenizer-ish files. Returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, size, **(config_overrides or {}))
    if not mtp:
        config["num_nextn_predict_layers"] = 0
    adapter = get_adapter(config)
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    elif fmt == "int4":
        ignore = adapter.ignore_patterns({Role.ROUTED_EXPERT})
        config["quantization_config"] = build_quantization_config(group_size, ignore)
    specs = adapter.inventory()
    groups = _shard_groups(specs, shards)
    weight_map: dict[str, str] = {}
    carried: dict[str, torch.Tensor] = {}  # scale_inv moved to the next shard (as real releases do)
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = dict(carried)
        carried = {}
        for spec in group:
            tensors.update(_physical(spec, fmt, seed, group_size))
        if i + 1 < len(groups):
            moved = [k for k in tensors if k.endswith("_scale_inv")][-1:]
            carried = {k: tensors.pop(k) for k in moved}
        _write(out / name, tensors)
        weight_map.update({k: name for k in tensors})
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    _dump(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _dump(out / "config.json", config)
    if extra_files:
        _write_extra_files(out, config)
    return out


# The image processor a Kimi K2.5 / K2.6 release carries beside its weights (moonshotai/Kimi-K2.5):
# preprocessor_config.json, whose `media_proc_cfg` vLLM's and SGLang's Kimi processors read while they build
# the model, and the remote code its `auto_map` names (placeholders here: carried over, never executed).
KIMI_MEDIA_PROC_CFG: dict[str, int | list[float] | None] = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384, "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None, "temporal_merge_kernel_size": 4, "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
}
KIMI_PROCESSOR_CODE = ("kimi_k25_processor.py", "kimi_k25_vision_processing.py", "media_utils.py")
KIMI_PROCESSOR_FILES = ("preprocessor_config.json", *KIMI_PROCESSOR_CODE)


def write_kimi_processor_files(dst: Path) -> None:
    """Write `KIMI_PROCESSOR_FILES` into the checkpoint folder `dst`."""
    auto_map = {"AutoProcessor": "kimi_k25_processor.KimiK25Processor",
                "AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"}
    _dump(dst / "preprocessor_config.json", {"auto_map": auto_map, "media_proc_cfg": KIMI_MEDIA_PROC_CFG})
    for name in KIMI_PROCESSOR_CODE:
        (dst / name).write_text(f'"""Stands in for the release\'s remote code {name} (carried over, never run)."""\n')


def wrap_multimodal(src: str | Path, dst: str | Path, wrapper: str = "kimi_k25", vision_tensor: bool = True) -> Path:
    """Copy checkpoint `src` into `dst` as a multimodal release (e.g. Kimi K2.5/K2.6's `kimi_k25`): every tensor
    under the wrapper's prefix, the text config under `text_config`, a tiny `vision_config` (the bundled
    Kimi K2.6 one, scaled down), the release's image-processor files and, with `vision_tensor`, one
    vision-tower tensor that must pass through."""
    import shutil

    from safetensors.torch import load_file

    from quantkit.arch import WRAPPERS

    record = WRAPPERS[wrapper]
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    weight_map: dict[str, str] = {}
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = {record.prefix + k: v for k, v in load_file(shard).items()}
        if not weight_map and vision_tensor:
            tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 48).to(torch.bfloat16)
        _write(shard, tensors)
        weight_map.update({k: shard.name for k in tensors})
    _dump(dst / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    text = json.loads((dst / "config.json").read_text())
    qc = text.pop("quantization_config", None)
    release = json.loads((PLAN_CONFIGS / "kimi-k2.6" / "config.json").read_text())
    vision = dict(release["vision_config"], text_hidden_size=text["hidden_size"], hidden_size=32, vt_hidden_size=32,
                  intermediate_size=64, vt_intermediate_size=64, num_attention_heads=2, vt_num_attention_heads=2,
                  num_hidden_layers=1, vt_num_hidden_layers=1, mm_hidden_size=32, init_pos_emb_height=4,
                  init_pos_emb_width=4)
    config: JSONObject = {"model_type": record.model_type, "architectures": [record.architecture],
                              "text_config": text, "vision_config": vision}
    if qc is not None:
        config["quantization_config"] = qc
    _dump(dst / "config.json", config)
    write_kimi_processor_files(dst)
    return dst


def _shard_groups(specs: list[TensorSpec], shards: int) -> list[list[TensorSpec]]:
    total = sum(s.numel for s in specs)
    groups: list[list[TensorSpec]] = [[]]
    acc = 0
    for spec in specs:
        if acc >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(spec)
        acc += spec.numel
    return groups


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    planned = [PlannedTensor(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    writer = StreamingShardWriter(path, planned)
    for k, v in tensors.items():
        writer.write(k, v)
    writer.finish()


def _dump(path: Path, value: JSON) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _write_extra_files(out: Path, config: JSONObject) -> None:
    """The non-weight files a release carries and a converter must not drop."""
    _dump(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "temperature": 0.7})
    _dump(out / "tokenizer_config.json", {"model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast"})
    (out / "chat_template.jinja").write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\n")
    (out / "configuration_custom.py").write_text('"""Custom code shipped with the model (carried over)."""\n')
    (out / "README.md").write_text(f"# synthetic {config['model_type']} checkpoint generated by quantkit.synth\n")
