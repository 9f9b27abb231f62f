"""`quantkit plan` and `quantkit report` from the command line: JSON fields, text, user errors."""

from __future__ import annotations

import json
import re

import pytest
import typer
from typer.testing import CliRunner

from quantkit.cli.plan import register
from quantkit.core.errors import QuantkitError

# The planner's commands on their own app: quantkit.cli would also import the kernels (torch).
app = typer.Typer()
register(app, typer.Typer(), typer.Typer())

REQUIRED = {
    "checkpoint_bytes",
    "weights_per_gpu_bytes",
    "kv_bytes_per_token_per_gpu",
    "kv_capacity_tokens",
    "max_concurrent_requests",
    "decode_tok_s",
    "prefill_tok_s",
    "assumptions",
}


def test_plan_json_has_the_documented_fields() -> None:
    result = CliRunner().invoke(
        app, ["plan", "glm-5.2", "--gpu", "h200", "--tp", "8", "--weights", "int4", "--kv", "fp8", "--json"]
    )
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)
    assert REQUIRED <= set(row)
    assert row["weights"] == "int4-g32" and row["kv"] == "fp8"
    assert row["assumptions"]["mem_fraction"] == 0.88 and row["assumptions"]["context"] == 32768


def test_compare_json_is_a_list_of_six_plans() -> None:
    result = CliRunner().invoke(app, ["plan", "kimi-k2.6", "--compare", "--json", "--mem-fraction", "0.85"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert len(rows) == 6 and all(REQUIRED | {"weights", "kv"} <= set(r) for r in rows)
    assert {r["assumptions"]["mem_fraction"] for r in rows} == {0.85}


def test_text_output_prints_units_assumptions_and_recommendation() -> None:
    result = CliRunner().invoke(app, ["plan", "glm-5.2", "--compare"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "GiB" in out and "mem_fraction" in out and "headroom_tokens" in out
    # the modelled best prefill KV is BF16, but the pair stock SGLang accepts runs FP8 on both sides (issue 19)
    assert "prefill: weights fp8 + KV fp8" in out and "prefill gives up" in out
    assert "decode: weights int4-g32 + KV fp8" in out
    assert "--kv-cache-dtype fp8_e4m3" in out and "--disaggregation-mode decode" in out
    single = CliRunner().invoke(app, ["plan", "glm-5.2", "--weights", "int4", "--kv", "fp8"]).output
    gib, gb = (float(x) for x in re.search(r"checkpoint\s+([\d.]+) GiB \(([\d.]+) GB\)", single).groups())
    assert abs(gib / 421 - 1) < 0.01 and abs(gb / (gib * 1.073741824) - 1) < 1e-3  # production: "421 GB" = GiB


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "glm-5.2", "--gpu", "tpu9"], "tpu9"),
        (["plan", "/nonexistent/config.json"], "/nonexistent/config.json"),
        (["plan", "glm-5.2", "--weights", "int3"], "int3"),
        (["report", "/nonexistent"], "/nonexistent"),
    ],
)
def test_bad_input_is_a_one_line_user_error(argv: list[str], needle: str) -> None:
    # quantkit.cli.main turns QuantkitError into "error: <message>" and exit status 2.
    result = CliRunner().invoke(app, argv)
    assert isinstance(result.exception, QuantkitError), result.output
    message = str(result.exception)
    assert needle in message and "\n" not in message


def test_ep_dp_attention_and_shared_expert_flags_reach_the_launch_commands(tmp_path) -> None:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(
        "gpus:\n  big: {memory_mib: 300000, bandwidth_tbs: 8, bf16_tflops: 2000, fp8_tflops: 4000}\n"
    )
    args = [
        "plan",
        "deepseek-v3",
        "--compare",
        "--ep",
        "--dp-attention",
        "--gpu",
        "big",
        "--gpu-file",
        str(gpus),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "--ep-size 8" in out and "--enable-dp-attention" in out and "--dp-size 8" in out
    # DeepSeek V3 disables shared-expert fusion for W4A16 itself (deepseek_v2.py): no flag, Marlin MoE
    assert "decode: weights int4-g32 + KV fp8" in out and "--moe-runner-backend marlin" in out
    assert "--disable-shared-experts-fusion" not in out
    assert "gpu_memory_mib                 300000" in out


def test_glm4_launch_command_disables_shared_expert_fusion_from_the_engine_record() -> None:
    """GLM-4.x is the family SGLang fuses shared experts for under W4A16 (dropping BF16 ones): the planner's
    decode command carries the flag and says FP8 KV would not get calibrated scales there."""
    result = CliRunner().invoke(app, ["plan", "glm-4.7", "--compare"])
    assert result.exit_code == 0, result.output
    decode = result.output.split("decode: weights int4", 1)[1]
    assert "--disable-shared-experts-fusion" in decode and "--moe-runner-backend marlin" in decode
    assert "scale 1.0" in result.output


def test_pd_json_is_the_pair_record_and_compare_prints_the_same_commands() -> None:
    from quantkit.engines.pd import PDPair, pd_problems
    from quantkit.plan.recommend import sglang_flags

    result = CliRunner().invoke(app, ["plan", "glm-5.2", "--gpu", "h200", "--tp", "8", "--pd", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert {"prefill", "decode", "router"} <= set(record) and record["router"]["args"][:3] == [
        "python", "-m", "sglang_router.launch_router"]
    pair = PDPair.from_dict(record)
    assert pd_problems(pair) == []
    assert pair.prefill.kv_dtype_resolved == pair.decode.kv_dtype_resolved == "fp8_e4m3"
    assert pair.prefill.kv_row_bytes == pair.decode.kv_row_bytes == 656  # DSA, flashmla_kv on both (SM90)
    assert pair.prefill.checkpoint == "<fp8-source>" and pair.decode.weights.startswith("int4")
    compare = CliRunner().invoke(app, ["plan", "glm-5.2", "--gpu", "h200", "--tp", "8", "--compare"]).output
    for side in (pair.prefill, pair.decode, pair.router):
        assert sglang_flags(side.args).replace("\n", "\n  ") in compare


def test_pd_split_json_is_the_plugin_record_and_gqa_models_get_none() -> None:
    """`--pd --split --json`: the production split through quantkit's SGLang plugin (BF16 KV on the prefill, the
    plugin's environment pointing at the decode's checkpoint); GLM-4.x (GQA) has none: a QuantkitError (main()
    prints it as one line, exit 2)."""
    from quantkit.engines.pd import PDPair, pd_problems
    from quantkit.serving.pd.sglang import DECODE_ENV, ENV, MODE

    result = CliRunner().invoke(app, ["plan", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--pd", "--split",
                                      "--json"])
    assert result.exit_code == 0, result.output
    pair = PDPair.from_dict(json.loads(result.output))
    assert pd_problems(pair) == [] and pair.prefill.env == {ENV: MODE, DECODE_ENV: pair.decode.checkpoint}
    assert pair.prefill.kv_row_bytes == 1152 and pair.prefill.sent_row == ("mla", 576) == (
        pair.decode.kv_row, pair.decode.kv_row_bytes)
    text = CliRunner().invoke(app, ["plan", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--pd"]).output
    assert f"{ENV}={MODE}" in text and "production split" in text
    gqa = CliRunner().invoke(app, ["plan", "glm-4.7", "--gpu", "h200", "--tp", "8", "--pd", "--split", "--json"])
    assert isinstance(gqa.exception, QuantkitError) and "MLA/DSA" in str(gqa.exception)
