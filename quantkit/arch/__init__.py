"""Architecture families: what each tensor of a checkpoint *is*, from its name and config.json alone.

`families.py` holds one record per family (transformers classes, default recipes, KV layout, MTP layout,
engine quirks, synthetic-model shape):
- `deepseek_v3`: DeepSeek V3/R1, Kimi K2.x (also inside the `kimi_k25` multimodal wrapper) — MLA attention.
- `glm4_moe`: GLM-4.5 .. 4.7 — GQA attention with qk-norm.
- `glm_moe_dsa`: GLM-5.x — MLA attention plus the DSA indexer.

The adapter (`base.py`) classifies names (role, layer, expert, MTP or not), lists the tensors a release
of that config holds (`inventory`, used by the planner and the converter's completeness check) and
carries the default ignore list that SGLang and vLLM load.
"""

from quantkit.arch.base import Adapter, IndexerRule, Role, TensorInfo, TensorSpec, get_adapter, text_config
from quantkit.arch.families import FAMILIES, WRAPPERS, Family, KVLayout, Wrapper, family_for, family_of_config

__all__ = [
    "FAMILIES", "WRAPPERS", "Adapter", "Family", "IndexerRule", "KVLayout", "Role", "TensorInfo", "TensorSpec",
    "Wrapper", "family_for", "family_of_config", "get_adapter", "text_config",
]
