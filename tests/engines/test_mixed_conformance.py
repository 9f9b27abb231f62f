"""Per-unit (mixed-precision) outputs: SGLang's and vLLM's own loader code, executed on what quantkit writes.

Each case converts a synthetic checkpoint with a per-unit plan (INT4 g32 / g64 / g128, INT8 g128, FP8-block and
BF16 units side by side, the MTP layer included) and launches both engines with exactly the args the record gives.
Every engine must: raise nothing (target and NextN / MTP draft); put every tensor into a parameter except those
the record says it skips; leave no parameter without data; give each MoE layer and each Linear the method of its
unit's format (WNA16 with that unit's bits and group, FP8, or unquantized); and give every quantized MoE layer a
runner under the one `--moe-runner-backend` the record pins. Two counter-cases show the rules are needed: the FP8
MoE mix under SGLang's `marlin` (no runner), and compressed-tensors' own top-level format `mixed-precision`
(SGLang's WNA16 MoE refuses it).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from cases import REAL_MLA
from harness import run_engine_batch

from quantkit.arch import get_adapter
from quantkit.checkpoint.synth import make_checkpoint
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe
from quantkit.quant.scheme import FORMATS
from quantkit.quant.units import unit_of

# name -> (family, source format, units); families' layer 0 is dense, 1-3 MoE, 4 the MTP layer ("small" shapes)
MIXES: dict[str, tuple[str, str, dict[str, str]]] = {
    "mla-fp8-moe": ("deepseek_v3", "fp8", {
        "layers.1.experts": "int8-g128", "layers.2.experts": "fp8-block", "layers.3.experts": "int4-g64",
        "layers.4.experts": "int4-g128", "layers.1.shared_experts": "int8-g128", "layers.2.attention": "int4-g128",
        "layers.3.attention": "int8-g128", "layers.0.mlp": "fp8-block", "layers.4.shared_experts": "fp8-block"}),
    "mla-int-bf16": ("deepseek_v3", "bf16", {
        "layers.1.experts": "int8-g128", "layers.2.experts": "bf16", "layers.3.experts": "int4-g32",
        "layers.4.experts": "int8-g128", "layers.2.shared_experts": "int4-g128", "layers.1.attention": "int8-g128",
        "layers.0.mlp": "int4-g64"}),
    "gqa-int": ("glm4_moe", "bf16", {
        "layers.1.experts": "int8-g128", "layers.2.experts": "int4-g128", "layers.3.experts": "int4-g64",
        "layers.1.attention": "int8-g128", "layers.2.attention": "int4-g32", "layers.0.mlp": "int4-g128",
        "layers.4.attention": "int4-g128"}),
    "dsa-fp8": ("glm_moe_dsa", "fp8", {
        "layers.1.experts": "fp8-block", "layers.2.experts": "int8-g128", "layers.3.experts": "int4-g32",
        "layers.4.experts": "fp8-block", "layers.3.attention": "int8-g128", "layers.2.shared_experts": "fp8-block",
        "layers.0.mlp": "int8-g128"}),
}
_MOE = re.compile(r"\.mlp\.experts(\.routed_experts)?$")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    outs = {}
    for name, (family, fmt, units) in MIXES.items():
        root = tmp_path_factory.mktemp(name)
        src = make_checkpoint(root / "src", family, fmt, size="small",
                              config_overrides=None if family == "glm4_moe" else dict(REAL_MLA))
        config = json.loads((src / "config.json").read_text())
        convert(src, root / "out", load_recipe(None, config, {"units": units}))
        outs[name] = root / "out"
    return outs


def _record(out: Path) -> dict:
    return json.loads((out / "quantkit.json").read_text())


@pytest.fixture(scope="module")
def reports(mixed: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """Both engines on every mix with the record's args, plus the two SGLang counter-cases, in one batch each."""
    fp8 = mixed["mla-fp8-moe"]
    ct_top = tmp_path_factory.mktemp("ct-top") / "out"
    shutil.copytree(fp8, ct_top)
    config = json.loads((ct_top / "config.json").read_text())
    config["quantization_config"]["format"] = "mixed-precision"  # what compressed-tensors 0.19 infers
    (ct_top / "config.json").write_text(json.dumps(config))
    out: dict[tuple[str, str], dict] = {}
    for engine in ("sglang", "vllm"):
        runs = [(o, _record(o)["serving"][engine]["args"]) for o in mixed.values()]
        extra = [(fp8, ["--moe-runner-backend", "marlin"]), (ct_top, _record(fp8)["serving"]["sglang"]["args"])]
        results = run_engine_batch(engine, runs + (extra if engine == "sglang" else []))
        out.update({(engine, name): r for name, r in zip(mixed, results, strict=False)})
        if engine == "sglang":
            out[("sglang", "fp8-under-marlin")], out[("sglang", "ct-top-format")] = results[-2:]
    return out


def _sections(report: dict) -> list[dict]:
    return [report] + ([report["draft"]] if report.get("draft") else [])


def _unit(adapter, module: str, mtp_layer: int) -> str | None:
    """The unit of an engine module name (fused / MoE / draft names mapped back to checkpoint names)."""
    name = module.replace("model.decoder.", f"model.layers.{mtp_layer}.").replace(".mtp_block.", ".")
    name = re.sub(r"\.experts(\.routed_experts)?$", ".experts.0.gate_proj", name)
    name = name.replace("gate_up_proj", "gate_proj").replace("qkv_proj", "q_proj")
    return unit_of(adapter, name)


def _expected(fmt: str | None) -> str:
    kind = FORMATS[fmt].kind if fmt else "bf16"
    return {"int": "WNA16", "fp8": "Fp8", "bf16": "none", "fp4": "FP4"}[kind]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_engine_loads_mixed_output_as_the_record_says(engine: str, mix: str, mixed, reports) -> None:
    out, report = mixed[mix], reports[(engine, mix)]
    record = _record(out)
    verdict = record["serving"][engine]
    assert verdict["verdict"] != "fails", verdict["problems"]
    formats = {u["unit"]: u["format"] for u in record["precision"]["units"]}
    assert {f for f in formats.values()} >= {f for f in MIXES[mix][2].values()}
    adapter = get_adapter(json.loads((out / "config.json").read_text()))
    for section in _sections(report):
        assert section["error"] is None, section["error"]
        assert [p for p in section["unloaded_params"]] == []
    skipped = set(report["skipped_tensors"])
    if report.get("draft"):
        skipped &= set(report["draft"]["skipped_tensors"])
    assert skipped - set(verdict["ignored_tensors"]) == set(), sorted(skipped)[:8]
    checked = set()
    for section in _sections(report):
        schemes = section["notes"].get("linear_schemes", {})  # vLLM names a Linear's scheme apart from its method
        for module, method in section["methods"].items():
            method = f"{method}:{schemes[module]}" if module in schemes else method
            unit = _unit(adapter, module, adapter.num_layers)
            if unit is None:  # not a unit: kept in BF16 (routers, kv_b, fused q_a/kv_a, indexer, heads)
                assert method is None or not re.search("WNA16|Fp8|FP4", method), (module, method)
                continue
            want, got = _expected(formats[unit]), method or "none"
            assert (want in got) if want != "none" else not re.search("WNA16|Fp8|FP4", got), (module, unit, got)
            checked.add(unit)
    assert checked >= {u for u, f in formats.items() if f != "bf16"}, "a quantized unit was not built"
    # every quantized MoE layer runs under the pinned backend, with its unit's bits and group
    for section in _sections(report):
        runners = section["notes"]["moe_runners" if engine == "sglang" else "moe_backends"]
        assert runners, "no quantized MoE layer reported"
        for module, info in runners.items():
            assert info["runner" if engine == "sglang" else "backend"] is not None, (module, info)
            fmt = FORMATS[formats[_unit(adapter, module, adapter.num_layers)]]
            if fmt.kind == "int" and info["bits"] is not None:
                assert (info["bits"], info["group"]) == (fmt.bits, fmt.group), (module, info)


def test_fp8_moe_layer_has_no_runner_under_marlin_so_the_record_pins_auto(mixed, reports) -> None:
    assert _record(mixed["mla-fp8-moe"])["serving"]["sglang"]["args"][:2] == ["--moe-runner-backend", "auto"]
    assert _record(mixed["mla-int-bf16"])["serving"]["sglang"]["args"][:2] == ["--moe-runner-backend", "marlin"]
    runners = reports[("sglang", "fp8-under-marlin")]["notes"]["moe_runners"]
    fp8 = {m: i for m, i in runners.items() if "Fp8" in str(i["scheme"])}
    assert fp8 and all(i["runner"] is None for i in fp8.values()), runners
    assert all(i["runner"] is not None for m, i in runners.items() if m not in fp8)


def test_compressed_tensors_top_level_mixed_precision_is_refused_by_sglang(reports) -> None:
    error = reports[("sglang", "ct-top-format")]["error"]
    assert error is not None and "pack-quantized" in error, error


def test_mixed_configs_parse_with_vllms_compressed_tensors_017(mixed) -> None:
    """vLLM 0.33.0 pins compressed-tensors 0.17.0; quantkit builds the per-unit config with 0.19.0."""
    import subprocess
    import sys

    from harness import CT017
    from test_conformance import _CT017_PARSE

    configs = [str(o / "config.json") for o in mixed.values()]
    res = subprocess.run([sys.executable, "-c", _CT017_PARSE, str(CT017), *configs], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["0.17.0", "pack-quantized", "False"] * len(configs)
