"""Build one transformers decoder layer from a source checkpoint's tensors, and nothing more.

The attention, norms, router and shared/dense MLPs are transformers' own modules for the architecture
(so the calibration forward is the model's real forward); the routed experts are replaced by
`quantkit.calibrate.moe.ExpertMoE`, which runs them one expert at a time from per-expert weights — the
on-disk layout — and collects per-expert Hessians. The layer is built on the meta device and filled with
tensors read (dequantized from FP8-block / INT4 / BF16) from the source, so peak memory is one layer.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quantkit.arch import family_for, text_config
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.core.distributed import SINGLE, World
from quantkit.core.errors import QuantkitError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["hf_config", "decoder_class", "build_layer", "rotary", "causal_mask"]



def hf_config(config: dict[str, Any]) -> PretrainedConfig:
    """A transformers config for the text model (quantization_config dropped: we dequantize ourselves)."""
    from transformers import AutoConfig

    text = dict(text_config(config))
    model_type = text.pop("model_type", None)
    try:
        hf_type = family_for(model_type).transformers.module
    except QuantkitError:
        raise QuantkitError(f"config.json: no calibration support for model_type {model_type!r}") from None
    for key in ("quantization_config", "auto_map", "architectures", "transformers_version"):
        text.pop(key, None)
    cfg = AutoConfig.for_model(hf_type, **text)
    cfg._attn_implementation = "sdpa"
    return cfg


def _module(model_type: str) -> ModuleType:
    import importlib

    name = family_for(model_type).transformers.module
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def decoder_class(cfg: PretrainedConfig) -> type[nn.Module]:
    return getattr(_module(cfg.model_type), family_for(cfg.model_type).transformers.decoder_layer)


def rotary(cfg: PretrainedConfig) -> nn.Module:
    """The model-level rotary embedding (it has no weights, only buffers computed from the config)."""
    return getattr(_module(cfg.model_type), family_for(cfg.model_type).transformers.rotary)(cfg)


def causal_mask(batch: int, seq: int) -> torch.Tensor:
    """Boolean `[batch, 1, seq, seq]` mask (True = may attend), the form DSA's indexer needs."""
    return torch.ones(seq, seq, dtype=torch.bool).tril_().expand(batch, 1, seq, seq)


def build_layer(source: SourceCheckpoint, cfg: PretrainedConfig, layer: int, prefix: str = "",
                lazy_experts: bool = False, world: World = SINGLE) -> nn.Module:
    """Decoder layer `layer` with weights from `source` (fp32; routed experts as `ExpertMoE`, held in the
    model dtype, or left in the source until GPTQ reads them with `lazy_experts`; with several ranks only
    the experts this rank owns are read)."""
    from quantkit.calibrate.moe import ExpertMoE

    with torch.device("meta"):
        module = decoder_class(cfg)(cfg, layer)
    base = f"{prefix}model.layers.{layer}."
    names = [n for n in source.logical_names() if n.startswith(base)]
    if not names:
        raise QuantkitError(f"{source.root}: no tensors for decoder layer {layer}")
    mlp = getattr(module, "mlp", None)
    if mlp is not None and hasattr(mlp, "experts"):
        module.mlp = ExpertMoE.from_source(source, cfg, base + "mlp.", mlp, lazy_experts, world)
    state: dict[str, torch.Tensor] = {}
    for name in names:
        rest = name[len(base) :]
        if rest.startswith("mlp.experts.") or rest.startswith("mlp.gate.") or rest.startswith("mlp.shared_experts."):
            if isinstance(module.mlp, ExpertMoE):
                continue  # loaded by ExpertMoE
        state[rest] = source.read(name, torch.float32)
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.startswith("mlp.") or not isinstance(module.mlp, ExpertMoE)]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise QuantkitError(f"{source.root}: decoder layer {layer} does not match its config ({what})")
    _materialise_buffers(module, cfg)
    return module.eval()


def _materialise_buffers(module: nn.Module, cfg: PretrainedConfig) -> None:
    """Buffers not stored in checkpoints (none today besides router bias defaults) must leave meta."""
    for name, buf in list(module.named_buffers()):
        if buf.is_meta:
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            owner.register_buffer(name.rsplit(".", 1)[-1], torch.zeros(buf.shape, dtype=torch.float32))
    for name, p in module.named_parameters():
        if p.is_meta:
            raise QuantkitError(f"decoder layer parameter {name} has no tensor in the checkpoint")
