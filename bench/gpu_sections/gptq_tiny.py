"""gptq_tiny: the tiny trained model calibrated on cuda and on the CPU with the same tokens, KL of each vs
the source."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_sections.common import Context, Report, SectionData, Skip, device_name, fmt, require, torch_device

if TYPE_CHECKING:
    from quantkit.calibrate.result import CalibrationResult


def _smoke_source(work: Path) -> Path:
    """A random-weight deepseek_v3 checkpoint (quantkit.checkpoint.synth) with the tiny models' BPE tokenizer."""
    from quantkit.calibrate.tiny import build_tokenizer
    from quantkit.checkpoint.synth import make_checkpoint

    src = make_checkpoint(work / "smoke-src", "deepseek_v3", "bf16", "tiny", mtp=False,
                          config_overrides={"vocab_size": 512})
    build_tokenizer(src)
    return src


def _code_agreement(a: CalibrationResult, b: CalibrationResult) -> float | None:
    """Share of packed int32 words (each holds 8 codes) identical between two calibration results."""
    same = total = 0
    for module in a.modules_quantized():
        pa, pb = a.quantized(module), b.quantized(module)
        total += pa.weight_packed.numel()
        if pb is not None:
            same += int((pa.weight_packed == pb.weight_packed).sum())
    return same / total if total else None


def run(ctx: Context, rep: Report) -> None:
    """Calibrate the tiny trained model on the CPU and on cuda with the same tokens; compare both to the source."""
    require("transformers", "tokenizers", "safetensors", "compressed_tensors", "pydantic")
    device = torch_device(ctx)
    rep.device = device_name(device)
    from transformers import AutoTokenizer

    from quantkit.arch import Role
    from quantkit.calibrate.data import calibration_tokens
    from quantkit.calibrate.eval import evaluate, fake_quantized_copy
    from quantkit.calibrate.runner import RunOptions, run
    from quantkit.calibrate.tiny import CORPUS, HELDOUT, build_tiny
    from quantkit.checkpoint.source import open_source
    from quantkit.quant.recipe import Recipe

    if ctx.smoke:
        src, samples, seq, windows = _smoke_source(ctx.work), 4, 64, 4
        rep.notes.append("smoke: a random-weight synthetic model, both runs on the CPU")
    else:
        t = time.perf_counter()
        src, samples, seq, windows = build_tiny("deepseek_v3"), 32, 128, 32
        rep.figures["model_ready_s"] = time.perf_counter() - t
    ctx.check_budget(margin=10)
    tokens = calibration_tokens(CORPUS, AutoTokenizer.from_pretrained(src), samples, seq, 0)
    recipe = Recipe(method="gptq", calibration={"dataset": str(CORPUS), "samples": samples, "seq_len": seq, "seed": 0})
    rep.figures.update(model=src.name, samples=samples, seq_len=seq, group_size=recipe.group_size, runs={})
    results, copies = {}, []
    for label, dev in (("cpu", "cpu"), ("cuda", device.type)):
        t = time.perf_counter()
        try:
            results[label] = run(open_source(src), recipe, ctx.work / f"calib-{label}", None,
                                 RunOptions(device=dev, tokens=tokens))
        except TypeError as exc:  # a runner without a device option: say so rather than guess
            raise Skip(f"the calibration runner does not take a device here ({exc})") from exc
        rep.figures["runs"][label] = {"device": dev, "seconds": time.perf_counter() - t}
        copy = ctx.work / f"fakequant-{label}"
        fake_quantized_copy(src, copy, results[label].quantized, recipe.group_size, {Role.ROUTED_EXPERT.value})
        copies.append(copy)
        rep.save()
        ctx.check_budget(margin=10)
    rep.figures["packed_words_identical"] = _code_agreement(results["cpu"], results["cuda"])
    ev = evaluate(copies, HELDOUT, reference=src, seq_len=seq, windows=windows)
    for label, copy in zip(("cpu", "cuda"), copies, strict=True):
        rep.figures["runs"][label].update(ev["models"][str(copy)])
    rep.figures["eval_tokens"] = ev["tokens"]
    rep.figures["source_perplexity"] = ev["reference"]["perplexity"]
    kl_cpu, kl_cuda = rep.figures["runs"]["cpu"]["kl_mean"], rep.figures["runs"]["cuda"]["kl_mean"]
    rep.figures["kl_cuda_over_cpu"] = kl_cuda / kl_cpu if kl_cpu > 0 else None



def summary_lines(tiny: SectionData) -> list[str]:
    f = tiny["figures"]
    lines = [f"Model {f.get('model')}, {f.get('samples')} x {f.get('seq_len')} calibration tokens, group "
             f"{f.get('group_size')}; evaluated on {f.get('eval_tokens', '-')} held-out tokens "
             f"(source perplexity {fmt(f.get('source_perplexity'), '.3f')}).", "",
             "| run | device | seconds | KL vs source | top-1 agreement | perplexity |",
             "|---|---|---:|---:|---:|---:|"]
    for label, r in f.get("runs", {}).items():
        lines.append(f"| {label} | {r['device']} | {r['seconds']:.1f} | {fmt(r.get('kl_mean'), '.3e')} "
                     f"| {fmt(r.get('top1_agreement') and 100 * r['top1_agreement'], '.2f', '%')} "
                     f"| {fmt(r.get('perplexity'), '.3f')} |")
    same = f.get("packed_words_identical") and 100 * f["packed_words_identical"]
    lines += ["", f"KL(cuda) / KL(cpu): {fmt(f.get('kl_cuda_over_cpu'), '.3f')}; packed words identical between "
              f"the two runs: {fmt(same, '.2f', '%')}."]
    return lines
