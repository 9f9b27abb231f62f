"""Which FP8 KV scale a checkpoint ships, and so which SGLang attention backend serves it: chosen by measurement.

The rule (docs/serving.md): ship scale 1.0 ("unit": every SGLang backend applies it consistently, so the fastest
one serves) when its measured KL cost over the consistent calibrated scale stays under

    max(10% of the INT4 weights' own KL, 2 standard errors of the paired difference)

and when the checkpoint's own calibration saw no value that saturates at 1.0 (|x| > 448); otherwise ship the
calibrated scales ("calibrated": only `--attention-backend triton` divides on write and multiplies on read).
10% of the INT4 weights' KL: the KV choice may add at most a tenth of the loss the user already accepted by
quantizing; the 2-se floor keeps a difference the measurement cannot resolve from deciding.

`MEASURED` holds the KL table of docs/serving.md, produced by one command (`MEASURED_BY`) on quantkit's tiny
trained models through SGLang 0.5.23's own KV write and attention read (tests/engines/run_sglang_kv_kl.py).
`UNIT_BACKEND` is the fastest backend consistent at scale 1.0 per GPU generation by the planner's attention
term (quantkit/plan/attention.py, from published kernel figures; tests/test_plan_attention.py asserts the
planner ranks it first at 8K / 32K / 128K context, 1 and 64 requests, for DeepSeek-V3 and Kimi-K2.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from quantkit.arch import KVLayout
from quantkit.engines.kv_backends import GpuArch

__all__ = ["DSA_BACKEND", "MEASURED", "MEASURED_BY", "SATURATION_LIMIT", "UNIT_BACKEND", "KVScaleMode", "MeasuredKL",
           "RequestedScales", "choose_scale_mode", "kv_choice_record", "sglang_mla_backend"]

KVScaleMode = Literal["unit", "calibrated"]
RequestedScales = Literal["auto", "unit", "calibrated"]
FRACTION_OF_INT4 = 0.10
SE_FLOOR = 2.0
SATURATION_LIMIT = 0.0  # a checkpoint whose calibration saw any value saturate at scale 1.0 keeps its scales
MEASURED_BY = "python bench/kv_backend_kl.py --windows 24 --seq 128 --prompt 64 (docs/serving.md)"
UNIT_BACKEND: dict[GpuArch, str] = {"sm90": "flashmla", "sm100": "trtllm_mla", "other": "triton"}
# DSA (no checkpoint scale): SGLang's per-tile 656 B rows (flashmla_kv) against the raw 576 B plain cast Blackwell's
# trtllm default stores: measured on the tiny GLM-5, the raw rows cost +1.43e-5 KL (se 4.5e-6) over per-tile,
# above the rule's threshold (10% of INT4's 1.33e-5, 2 se = 9.1e-6): records pin flashmla_kv on every GPU.
DSA_BACKEND = "flashmla_kv"


@dataclass(frozen=True)
class MeasuredKL:
    """One tiny model's measured KL (to its BF16-KV twin, decode positions) for the rule."""

    model: str
    kl_calibrated: float  # configuration b: calibrated scale, written / s and read x s (triton)
    kl_unit: float  # the worst unit-scale read measured (a, a_triton, a_flashmla)
    unit_read: str
    delta: float  # paired mean of kl_unit - kl_calibrated over windows
    se: float  # its bootstrap standard error
    kl_int4: float  # INT4 weights alone, BF16 KV
    kl_eager: float | None = None  # MLA, calibrated + triton with the prompt rows plain-cast (eager prefill)

    @property
    def threshold(self) -> float:
        return max(FRACTION_OF_INT4 * self.kl_int4, SE_FLOOR * self.se)

    @property
    def choice(self) -> KVScaleMode:
        return "unit" if self.delta <= self.threshold else "calibrated"


MEASURED: dict[KVLayout, MeasuredKL] = {  # `MEASURED_BY`, 2026-12-06 (docs/serving.md)
    KVLayout.MLA: MeasuredKL("deepseek_v3", kl_calibrated=2.32e-4, kl_unit=3.43e-4, unit_read="a_flashmla",
                             delta=1.11e-4, se=1.83e-4, kl_int4=8.90e-4, kl_eager=9.81e-2),
    KVLayout.GQA: MeasuredKL("glm4_moe", kl_calibrated=1.31e-4, kl_unit=9.53e-5, unit_read="a_triton",
                             delta=-3.52e-5, se=2.80e-5, kl_int4=3.69e-5),
}


def choose_scale_mode(layout: KVLayout, requested: RequestedScales = "auto",
                      saturated_at_1: float | None = None) -> tuple[KVScaleMode, str]:
    """The scale a checkpoint ships (`unit` / `calibrated`) and why, for the layout's MLA / GQA KV scales."""
    if requested != "auto":
        return requested, f"--kv-scales {requested}"
    if saturated_at_1 is not None and saturated_at_1 > SATURATION_LIMIT:
        return "calibrated", (f"the calibration saw {saturated_at_1:.4%} of KV values saturate at scale 1.0 "
                              "(|x| > 448): the calibrated scales are kept")
    m = MEASURED.get(layout)
    if m is None:
        return "calibrated", f"no KL measurement for {layout.value} KV: the calibrated scales are kept"
    verb = "<=" if m.choice == "unit" else ">"
    return m.choice, (f"measured on the tiny {m.model}: scale 1.0 ({m.unit_read}) costs {m.delta:+.2e} KL over the "
                      f"calibrated scale {verb} the threshold {m.threshold:.2e} (max of 10% of the INT4 weights' "
                      f"{m.kl_int4:.2e}, 2 se {2 * m.se:.2e}); docs/serving.md")


def sglang_mla_backend(mode: KVScaleMode, arch: GpuArch) -> str:
    """The MLA backend a record pins: triton for calibrated scales (the one that applies them), else the fastest
    backend consistent at scale 1.0 on the GPU generation."""
    return "triton" if mode == "calibrated" else UNIT_BACKEND[arch]


def kv_choice_record(layout: KVLayout, mode: KVScaleMode, arch: GpuArch = "sm90") -> dict[str, object] | None:
    """The record's `kv_choice` block (MLA / GQA): the scale shipped, both options with their backend and
    measured KL, the paired KL delta, the threshold and the command that measured them."""
    if layout == KVLayout.DSA:
        return None
    m = MEASURED.get(layout)
    unit_backend = UNIT_BACKEND[arch] if layout == KVLayout.MLA else "engine default"
    options: dict[str, dict[str, object]] = {
        "calibrated": {"backend": "triton" if layout == KVLayout.MLA else "SGLang: not loadable (GLM-4.x)",
                       "kl": m.kl_calibrated if m else None},
        "unit": {"backend": unit_backend, "kl": m.kl_unit if m else None, "read": m.unit_read if m else None}}
    if m is not None and m.kl_eager is not None:
        options["calibrated"]["kl_eager_prefill"] = m.kl_eager
    return {"shipped": mode, "options": options,
            "kl_delta_unit_minus_calibrated": m.delta if m else None, "se": m.se if m else None,
            "threshold": m.threshold if m else None, "kl_int4": m.kl_int4 if m else None,
            "rule_choice": m.choice if m else None, "measured_on": m.model if m else None,
            "measured_by": MEASURED_BY}
