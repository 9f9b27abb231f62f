"""compressed-tensors' own FP4 path, for the byte-identity tests: llm-compressor's weight calibration
(observers, fused observers sharing one global scale) then compressed-tensors' compressor. No quantkit code."""

from __future__ import annotations

import torch


def ct_compress(weights: list[torch.Tensor], preset: str) -> list[dict[str, torch.Tensor]]:
    """Each weight's compressed tensors (weight_packed, weight_scale[, weight_global_scale]); weights given
    together are one fused group (shared global scale), as llm-compressor's calibrated path fuses them."""
    from compressed_tensors.compressors import compress_module
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.entrypoints.model_free.lifecycle import calibrate_weight, initialize_quantized_linear
    from llmcompressor.modifiers.quantization.calibration import (
        apply_calibration_status,
        freeze_module_quantization,
        initialize_observer,
        observe,
        update_qparams,
    )
    from llmcompressor.observers import FusionHandler

    scheme = preset_name_to_scheme(preset, ["Linear"])
    mods = [initialize_quantized_linear(w, scheme, "cpu") for w in weights]
    if len(mods) > 1:
        for m in mods:
            initialize_observer(m, "weight")
            apply_calibration_status(m)
        FusionHandler.fuse([(m.weight_observer, m) for m in mods])
        observe(mods, base_name="weight")
        update_qparams(mods, base_name="weight")
        for m in mods:
            freeze_module_quantization(m)
    else:
        calibrate_weight(mods[0])
    out = []
    for m in mods:
        compress_module(m)
        out.append({k: v.detach() for k, v in m.state_dict().items()})
    return out


def ct_only_compress(weights: list[torch.Tensor], preset: str) -> list[dict[str, torch.Tensor]]:
    """The same through compressed-tensors alone (`generate_gparam` over the fused group, `calculate_qparams`,
    the registered compressor): works with any compressed-tensors 0.17-0.20 first on sys.path."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    fmt = "nvfp4-pack-quantized" if args.group_size == 16 else "mxfp4-pack-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    global_scale = None
    if args.group_size == 16:
        lo = torch.stack([w.amin() for w in weights]).amin()
        hi = torch.stack([w.amax() for w in weights]).amax()
        global_scale = generate_gparam(lo, hi)
    out = []
    for w in weights:
        grouped = w.unflatten(-1, (-1, args.group_size))
        scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=global_scale)
        state = {"weight": w, "weight_scale": scale.to(w.dtype) if args.group_size == 16 else scale}
        if global_scale is not None:
            state["weight_global_scale"] = global_scale
        out.append(dict(compressor.compress(state, scheme)))
    return out
