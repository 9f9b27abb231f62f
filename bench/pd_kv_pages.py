"""Cost per page of the PD plugin's BF16 -> FP8 MLA page conversion: ``python bench/pd_kv_pages.py [--device cuda]``.

Times `quantkit.serving.sglang_pd.mla_pages_to_fp8` (latent / the decode layer's k_scale, cast to FP8) on pages
of DeepSeek / Kimi geometry (512 latent + 64 rope, BF16 in, 576 B per token out), at page sizes 1 and 64,
best of 7 runs over a batch of pages. The DSA conversion is SGLang's own Triton quantizer (GPU only; on the CPU
it runs in Triton's interpreter, which measures nothing useful), so it is not timed here.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quantkit.serving.sglang_pd import mla_pages_to_fp8

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(1, 4096, args.device), measure(64, 256, args.device)]
    result = {"device": args.device, "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"device {args.device}, {result['threads']} threads")
    for r in rows:
        print(f"page {r['page_size']:>3}: {r['us_per_page']:>9.3f} us/page ({r['bytes_out_per_page']:,} B out, "
              f"{r['gb_s_in']} GB/s of BF16 in)")


if __name__ == "__main__":
    main()
