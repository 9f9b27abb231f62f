"""The PD pair record and its checks (no engine needed; tests/engines/test_pd_pair.py runs SGLang's own)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from quantkit.engines.kv_backends import BACKENDS, sglang_default_backend
from quantkit.engines.pd import PDPair, pd_pair, pd_problems
from quantkit.engines.verdicts import engine_verdicts, facts_from_recipe
from quantkit.plan.models import resolve_model
from quantkit.quant.recipe import load_recipe


def _facts(model: str, kv_scales: bool = True, mode: str | None = None):
    """Facts of quantkit's INT4 output; `mode` forces the KV scales shipped (None: the measured rule's)."""
    config = resolve_model(model).config
    return facts_from_recipe(config, 32, load_recipe(None, config).quantize_roles, kv_scales, kv_scale_mode=mode)


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2.6", "glm-5.2", "glm-4.7"])
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_default_pair_passes_its_checks_and_roundtrips(model: str, arch: str) -> None:
    pair = pd_pair(_facts(model), arch=arch)
    assert pd_problems(pair) == []
    assert PDPair.from_dict(pair.to_dict()) == pair
    for side in (pair.prefill, pair.decode):
        assert side.args[side.args.index("--kv-cache-dtype") + 1] == "fp8_e4m3" == side.kv_dtype_resolved
        assert side.args[side.args.index("--page-size") + 1] == str(side.page_size)
    assert "BF16" in pair.gives_up and "FP8" in pair.gives_up  # what the prefill gives up, stated


def test_each_check_names_the_flag() -> None:
    pair = pd_pair(_facts("glm-5.2"))
    p, d = pair.prefill, pair.decode
    cases = {
        "--page-size": replace(pair, decode=replace(d, page_size=1)),
        "--kv-cache-dtype": replace(pair, prefill=replace(p, kv_cache_dtype="auto", kv_dtype_resolved="auto")),
        "--dsa-prefill-backend/--dsa-decode-backend": replace(pair, decode=replace(d, kv_row="dsa-576",
                                                                                     kv_row_bytes=576)),
        "--attention-backend": replace(pair, decode=replace(d, kv_scale="calibrated")),
    }
    for flag, broken in cases.items():
        problems = pd_problems(broken)
        assert len(problems) == 1 and flag in problems[0], (flag, problems)
    auto = replace(pair, prefill=replace(p, kv_dtype_resolved="auto", dtype="float16"),
                   decode=replace(d, kv_dtype_resolved="auto"))
    assert any("--dtype" in x for x in pd_problems(auto))


def test_mla_record_pins_a_backend_that_applies_the_calibrated_scale() -> None:
    """Calibrated MLA scales: SGLang's defaults read x k_scale without dividing on write (trtllm_mla on SM100)
    or ignore it (fa3 on SM90); the record pins the backend that divides on write and multiplies on read."""
    sglang = engine_verdicts(_facts("deepseek-v3", mode="calibrated"), ("sglang",))["sglang"]
    assert sglang.kv_cache.scale == "calibrated"
    backend = sglang.args[sglang.args.index("--attention-backend") + 1]
    verdicts = {b.name: b.verdict for b in BACKENDS if b.engine == "sglang"}
    assert verdicts[backend] == "consistent" and sglang.kv_cache.attention_backend == backend
    from quantkit.arch import KVLayout

    assert {verdicts[sglang_default_backend(KVLayout.MLA, a)] for a in ("sm90", "sm100")} == {"ignored", "inconsistent"}


def test_pd_pair_runs_one_scale_on_both_sides() -> None:
    """The prefill's FP8 source has no KV scales: the decode must not apply its calibrated one to those pages."""
    pair = pd_pair(_facts("deepseek-v3", mode="calibrated"), arch="sm100")
    assert pair.prefill.kv_scale == pair.decode.kv_scale == "1.0"
    assert pair.decode.attention_backend != "triton" and pair.notes


def test_pd_plugin_is_a_no_op_unless_switched_on(monkeypatch) -> None:
    from quantkit.serving.pd import sglang as sglang_pd
    monkeypatch.delenv(sglang_pd.ENV, raising=False)
    assert sglang_pd.register() is None and not sglang_pd._STATE.registered  # nothing imported, nothing hooked
    monkeypatch.setenv(sglang_pd.ENV, "fp8-to-bf16")
    with pytest.raises(sglang_pd.PluginNotReady, match="only mode"):
        sglang_pd.register()


def _staging(page: int, slots: int, scales=(1.0, 0.05), tokens: int = 8):
    import torch

    from quantkit.serving.pd.staging import PageStaging, StagedLayer

    torch.manual_seed(page)
    layers = [StagedLayer((torch.randn((tokens + 1) * page, 1, 576) * 3).to(torch.bfloat16), s) for s in scales]
    return PageStaging(layers, page, "mla", 512, 64, slots), layers


@pytest.mark.parametrize("page", [1, 64])
def test_staging_sends_every_page_converted_at_its_layers_scale(page: int) -> None:
    """Pages go out in rounds of at most `slots` pages; each destination page receives the BF16 page converted at
    its own layer's scale (the decode's bytes), and nothing else is written."""
    import numpy as np
    import torch

    from quantkit.serving.pd.staging import mla_pages_to_fp8

    staging, layers = _staging(page, slots=3)
    assert staging.item_len == page * 576 and staging.buf_infos()[2] == [page * 576] * 2
    decode = [torch.zeros(10, page, 576, dtype=torch.uint8) for _ in layers]
    rounds = []

    def send(slots, dst) -> int:  # the transfer engine: raw bytes, staging slot -> decode page
        rounds.append(len(slots))
        for buf, out in zip(staging.buffers, decode, strict=True):
            out[torch.as_tensor(dst)] = buf[torch.as_tensor(slots)]
        return 0

    src, dst = np.array([5, 1, 2, 7, 0, 3, 6]), np.array([9, 2, 3, 4, 8, 0, 1])
    assert staging.send(src, dst, send) == 0 and rounds == [3, 3, 1]
    for layer, out in zip(layers, decode, strict=True):
        pages = layer.source.reshape(-1, page, 576)
        want = mla_pages_to_fp8(pages[torch.as_tensor(src)], layer.k_scale)
        assert torch.equal(out[torch.as_tensor(dst)], want)
        assert not out[torch.as_tensor([5, 6, 7])].any()  # pages nobody sent stay untouched
    assert not torch.equal(decode[0], decode[1])  # the two layers' scales differ
    assert sorted(staging._free) == [0, 1, 2]  # every slot returned


def test_staging_stops_at_the_first_failed_round_and_frees_its_slots() -> None:
    import numpy as np

    staging, _ = _staging(1, slots=2)
    calls = []
    status = staging.send(np.arange(6), np.arange(6), lambda s, d: calls.append(1) or (-1 if len(calls) == 2 else 0))
    assert status == -1
    assert len(calls) == 2 and sorted(staging._free) == [0, 1]


def test_staging_shares_its_slots_between_sending_threads() -> None:
    """SGLang sends from several transfer threads at once: no slot is handed to two rounds at the same time."""
    import threading

    import numpy as np

    staging, _ = _staging(1, slots=4, tokens=64)
    in_use: set[int] = set()
    lock, clashes = threading.Lock(), []

    def send(slots, dst) -> int:
        with lock:
            clashes.extend(set(slots.tolist()) & in_use)
            in_use.update(slots.tolist())
        threading.Event().wait(0.002)
        with lock:
            in_use.difference_update(slots.tolist())
        return 0

    threads = [threading.Thread(target=staging.send, args=(np.arange(i, 64, 4), np.arange(16), send))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clashes == [] and sorted(staging._free) == [0, 1, 2, 3]


def test_staging_refuses_a_pool_it_cannot_convert() -> None:
    import torch

    from quantkit.serving.pd.staging import PageStaging, StagedLayer

    with pytest.raises(ValueError, match="BF16"):
        PageStaging([StagedLayer(torch.zeros(64, 1, 576, dtype=torch.float8_e4m3fn))], 64, "mla", 512, 64, 4)


@pytest.mark.parametrize(("model", "row", "scale", "mode"), [("deepseek-v3", "mla", "calibrated", "calibrated"),
                                                             ("kimi-k2.6", "mla", "calibrated", "calibrated"),
                                                             ("deepseek-v3", "mla", "1.0", "unit"),
                                                             ("glm-5.2", "dsa-656", "per-tile", None)])
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_plugin_split_record(model: str, row: str, scale: str, mode: str | None, arch: str) -> None:
    """The production split: prefill BF16 KV on the source with the plugin's environment, decode FP8 at the scale
    its backend applies; the wire carries the decode's dtype string and rows, so the pair's checks pass."""
    from quantkit.engines.pd import pd_split
    from quantkit.serving.pd.sglang import DECODE_ENV, ENV, MODE

    pair = pd_split(_facts(model, mode=mode), arch=arch)
    p, d = pair.prefill, pair.decode
    assert pd_problems(pair) == [] and PDPair.from_dict(pair.to_dict()) == pair
    assert p.args[p.args.index("--kv-cache-dtype") + 1] == "auto" and p.kv_row_bytes == 1152
    assert p.env == {ENV: MODE, DECODE_ENV: d.checkpoint} and p.advertised == d.kv_dtype_resolved == "fp8_e4m3"
    assert p.sent_row == (d.kv_row, d.kv_row_bytes) == (row, 576 if row == "mla" else 656)
    assert d.kv_scale == scale
    if row == "mla":  # calibrated: the backend that applies the scale; 1.0: the fastest consistent one
        from quantkit.engines.kv_choice import UNIT_BACKEND

        expected = "triton" if mode == "calibrated" else UNIT_BACKEND[arch]  # type: ignore[index]
        assert d.args[d.args.index("--attention-backend") + 1] == expected
    broken = {"env": replace(pair, prefill=replace(p, env={ENV: MODE})),
              "fp8 prefill": replace(pair, prefill=replace(p, kv_dtype_resolved="fp8_e4m3")),
              "rows": replace(pair, prefill=replace(p, wire_row="dsa-576", wire_row_bytes=576))}
    for name, bad in broken.items():
        assert pd_problems(bad), name


def test_pair_on_one_checkpoint_applies_the_calibrated_scale_on_both_sides() -> None:
    """Kimi on 8 x H200: only INT4 fits, both sides load quantkit's output with its calibrated MLA scales, so both
    pin the backend that applies them (divide on write, multiply on read) and agree."""
    pair = pd_pair(_facts("kimi-k2.6", mode="calibrated"), weights="int4-g32", prefill_weights="int4-g32")
    assert pd_problems(pair) == [] and pair.prefill.checkpoint == pair.decode.checkpoint == "<MODEL>"
    assert pair.prefill.kv_scale == pair.decode.kv_scale == "calibrated"
    assert pair.prefill.attention_backend == pair.decode.attention_backend == "triton"
    assert "--moe-runner-backend" in pair.prefill.args and "the calibrated scale" in pair.gives_up
