"""What SGLang 0.5.23 and vLLM 0.33.0 do with an FP4 checkpoint (the FP4 rules of `engines.verdicts`, docs/fp4.md).

Each rule names the engine source that decides it; tests/engines executes that code (scheme selection, weight
loading) on quantkit's FP4 outputs. The kernels that run per GPU generation are the engines' choice and are
recorded as read from their sources, not executed (no GPU here).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["FP4_GPUS", "WeightScheme", "fp4_sglang", "fp4_vllm"]

WeightScheme = Literal["w4a16", "nvfp4a16", "mxfp4a16", "nvfp4"]  # = quantkit.quant.recipe.Scheme
_Engine = Literal["sglang", "vllm"]

# What each engine runs per GPU generation for an FP4 checkpoint (scheme selection executed by
# tests/engines at SM 9.0 and SM 10.0; the kernels themselves are the engines' choice, not run here).
FP4_GPUS: dict[_Engine, dict[WeightScheme, dict[str, str]]] = {
    "sglang": {
        "nvfp4a16": {"hopper (SM90)": "weight-only FP4 Marlin (CompressedTensorsW4A16Fp4 / W4A16Nvfp4MoE)",
                     "blackwell (SM100)": "weight-only FP4 Marlin (same schemes: the checkpoint has no "
                                          "activation scales)"},
        "mxfp4a16": {"hopper (SM90)": "does not load", "blackwell (SM100)": "does not load"},
        "nvfp4": {"hopper (SM90)": "weight-only FP4 Marlin (CompressedTensorsW4A16Fp4 / W4A16Nvfp4MoE: below SM100 "
                                   "the W4A4 checkpoint is served weight-only, input_global_scale unused)",
                  "blackwell (SM100)": "W4A4 NVFP4 (CompressedTensorsW4A4Fp4 / W4A4Nvfp4MoE): activations quantized "
                                       "to NVFP4 with the calibrated input_global_scale"},
    },
    "vllm": {
        "nvfp4a16": {"hopper (SM90)": "weight-only FP4 Marlin (CompressedTensorsW4A4Fp4 / W4A4Nvfp4MoEMethod, "
                                      "use_a16)",
                     "blackwell (SM100)": "weight-only NVFP4 (use_a16: activations stay BF16)"},
        "mxfp4a16": {"hopper (SM90)": "weight-only MXFP4 (CompressedTensorsW4A4Mxfp4 / W4A4Mxfp4MoEMethod)",
                     "blackwell (SM100)": "W4A4: the MXFP4 schemes quantize activations to MXFP4 dynamically"},
        "nvfp4": {"hopper (SM90)": "weight-only FP4 Marlin (CompressedTensorsW4A4Fp4 / W4A4Nvfp4MoEMethod fall back "
                                   "to Marlin below SM100; input_global_scale loaded, not used)",
                  "blackwell (SM100)": "W4A4 NVFP4: native FP4 GEMMs, activations quantized with the calibrated "
                                       "input_global_scale"},
    },
}


def fp4_sglang(scheme: WeightScheme, problems: list[str]) -> list[str]:
    """SGLang 0.5.23 on an FP4 checkpoint; returns notes, appends problems."""
    if scheme == "mxfp4a16":
        # compressed_tensors.py: no MXFP4 scheme for a Linear (NotImplementedError); the MoE lookup fails with
        # "Unable to find matching target for ...experts.0.gate_proj" (executed by tests/engines).
        problems.append("SGLang 0.5.23 has no compressed-tensors MXFP4 path for these models (MoE: 'Unable to find "
                        "matching target'; dense: NotImplementedError); serve MXFP4A16 with vLLM or use nvfp4a16")
        return []
    if scheme == "nvfp4":
        return ["NVFP4 W4A4: native W4A4 on Blackwell (CompressedTensorsW4A4Nvfp4MoE), weight-only FP4 Marlin below "
                "SM100; gate/up weight and input global scales are fused per expert"]
    # compressed_tensors_w4a16_nvfp4_moe.py: the gate and up projections of an expert must share one
    # weight_global_scale (quantkit writes them fused); weight-only through the FP4 Marlin runner.
    return ["NVFP4A16: weight-only FP4 through Marlin on every GPU generation (CompressedTensorsW4A16Nvfp4MoE); "
            "gate/up global scales are fused per expert as SGLang requires"]


def fp4_vllm(scheme: WeightScheme, warnings: list[str]) -> list[str]:
    """vLLM 0.33.0 on an FP4 checkpoint; returns notes, appends warnings."""
    if scheme == "mxfp4a16":
        # compressed_tensors_w4a4_mxfp4.py: the MXFP4 schemes always request dynamic MXFP4 activations.
        warnings.append("vLLM serves an MXFP4A16 checkpoint as W4A4 on Blackwell (dynamic MXFP4 activations): "
                        "expect a quality step from weight-only")
        return []
    if scheme == "nvfp4":
        return ["NVFP4 W4A4: Blackwell runs native NVFP4 GEMMs with the calibrated input_global_scale; Hopper "
                "weight-only FP4 Marlin; one weight and one input global scale per fused gate/up pair"]
    # CompressedTensorsW4A4Nvfp4MoEMethod(use_a16=True) creates *_input_global_scale and never uses them.
    return ["NVFP4A16: weight-only; Hopper runs FP4 Marlin, Blackwell native NVFP4 weights with BF16 activations; "
            "vLLM keeps one global scale for a fused gate/up pair (quantkit writes them equal)"]
