"""Architecture adapters: what each tensor of a checkpoint *is*, from its name and config.json alone.

One adapter serves a family of models that share tensor names:
- `deepseek_v3`: DeepSeek V3/R1, Kimi K2.x (also inside the `kimi_k25` multimodal wrapper) — MLA attention.
- `glm4_moe`: GLM-4.5 .. 4.7 — GQA attention with qk-norm.
- `glm_moe_dsa`: GLM-5.x — MLA attention plus the DSA indexer.

An adapter classifies names (role, layer, expert, MTP or not), lists the tensors a release of that
config holds (`inventory`, used by the planner and the converter's completeness check) and carries the
default ignore list that SGLang and vLLM load.
"""

from quantkit.arch.base import Adapter, Role, TensorInfo, TensorSpec, get_adapter, text_config

__all__ = ["Adapter", "Role", "TensorInfo", "TensorSpec", "get_adapter", "text_config"]
