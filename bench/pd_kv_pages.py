"""Cost per page of the PD plugin's BF16 -> FP8 MLA page conversion: ``python bench/pd_kv_pages.py [--device cuda]``.

Times `quantkit.serving.pd.sglang.mla_pages_to_fp8` (latent / the decode layer's k_scale, cast to FP8) on pages
of DeepSeek / Kimi geometry (512 latent + 64 rope, BF16 in, 576 B per token out), at page sizes 1 and 64,
best of 7 runs over a batch of pages; and the whole send-side round the plugin adds per request
(`PageStaging.send`: gather the request's pages from each of 61 layers' BF16 buffers, convert at that layer's
scale, scatter into staging slots; the transfer itself is SGLang's and not timed), per page over all layers.
The DSA conversion is SGLang's own Triton quantizer (GPU only; on the CPU
it runs in Triton's interpreter, which measures nothing useful), so it is not timed here.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from quantkit.serving.pd.sglang import mla_pages_to_fp8
from quantkit.serving.pd.staging import PageStaging, StagedLayer

WIDTH = 512 + 64


def measure(page: int, pages: int, device: str, repeats: int = 7) -> dict[str, float]:
    src = (torch.randn(pages, page, WIDTH, device=device) * 3).to(torch.bfloat16)
    mla_pages_to_fp8(src, 0.05)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        mla_pages_to_fp8(src, 0.05)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    per_page = best / pages
    return {"page_size": page, "pages": pages, "us_per_page": round(per_page * 1e6, 3),
            "bytes_out_per_page": page * WIDTH, "gb_s_in": round(page * WIDTH * 2 / per_page / 1e9, 2)}


def measure_staging(page: int, pages: int, device: str, layers: int = 61, repeats: int = 5) -> dict[str, float]:
    """One request of `pages` pages through the staging (all `layers` layers), as the plugin's send hook runs it."""
    pool = [StagedLayer((torch.randn((2 * pages + 1) * page, 1, WIDTH, device=device) * 3).to(torch.bfloat16),
                        0.05 + i / 1000) for i in range(layers)]
    staging = PageStaging(pool, page, "mla", 512, 64, slots=pages)
    src, dst = np.random.default_rng(0).permutation(2 * pages)[:pages], np.arange(pages)
    staging.send(src, dst, lambda s, d: 0)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        staging.send(src, dst, lambda s, d: 0)
        best = min(best, time.perf_counter() - t)  # send() synchronizes on cuda before handing slots over
    per_page = best / pages
    return {"page_size": page, "pages": pages, "layers": layers, "us_per_page_all_layers": round(per_page * 1e6, 2),
            "bytes_out_per_page_all_layers": page * WIDTH * layers,
            "staging_mib": round(sum(b.nbytes for b in staging.buffers) / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(1, 4096, args.device), measure(64, 256, args.device)]
    staged = [measure_staging(1, 2048, args.device), measure_staging(64, 32, args.device)]
    result = {"device": args.device, "threads": torch.get_num_threads(), "rows": rows, "staging": staged}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"device {args.device}, {result['threads']} threads")
    for r in rows:
        print(f"page {r['page_size']:>3}: {r['us_per_page']:>9.3f} us/page ({r['bytes_out_per_page']:,} B out, "
              f"{r['gb_s_in']} GB/s of BF16 in)")
    for r in staged:
        print(f"staging round, page {r['page_size']:>3} x {r['layers']} layers: {r['us_per_page_all_layers']:>9.2f} "
              f"us/page ({r['bytes_out_per_page_all_layers']:,} B out; staging {r['staging_mib']} MiB)")


if __name__ == "__main__":
    main()
