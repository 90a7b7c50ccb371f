#!/usr/bin/env python3
"""The grouped GEMM's results against issue 5's targets, as a markdown table.

Reads `megamoe bench-gemm --json` files (several rounds of the same cases are folded per case: the
median of the rounds' kernel medians, and their range) and prints one row per case: kernel µs,
TFLOP/s and weight TB/s by kernel time (CUPTI), the cuBLASLt dense fp8 peer where it ran, and the
target the issue sets for that shape, met or not.
  python3 scripts/gemm_targets.py OUT/*.json

The targets (issue 5): 0.9x the DeepGEMM SM90 figures it quotes, measured on these H200s: deepseek-v3
32 experts x 512 rows FC1 1398 / FC2 1304, x 2048 rows 1402 / 1351, 128 experts x 128 rows (FC1) 1026;
qwen3-30b-a3b 64 experts x 256 rows FC1 1115 / FC2 921; >= 1250 TFLOP/s at >= 512 rows per expert on
the deepseek-v3 shapes; weights streamed at >= 3.5 TB/s at <= 32 rows per expert.
"""
import json
import statistics
import sys

DEEPGEMM = {  # (model, experts, rows per expert, fc): DeepGEMM TFLOP/s quoted in the issue
    ("deepseek-v3", 32, 512, "fc1"): 1398, ("deepseek-v3", 32, 512, "fc2"): 1304,
    ("deepseek-v3", 32, 2048, "fc1"): 1402, ("deepseek-v3", 32, 2048, "fc2"): 1351,
    ("deepseek-v3", 128, 128, "fc1"): 1026,
    ("qwen3-30b-a3b", 64, 256, "fc1"): 1115, ("qwen3-30b-a3b", 64, 256, "fc2"): 921,
}


def targets(model, experts, rows, fc):
    """[(label, value, unit)] for one case; empty where the issue sets none."""
    if fc == "fc1+swiglu":
        return []
    if rows <= 32:
        return [("3.5 TB/s", 3500.0, "GB/s")]
    out = []
    dg = DEEPGEMM.get((model, experts, rows, fc))
    if dg:
        out.append((f"0.9 x DeepGEMM {dg} = {0.9 * dg:.0f}", 0.9 * dg, "TF"))
    if model == "deepseek-v3" and rows >= 512:
        out.append(("1250", 1250.0, "TF"))
    return out


def table_lines(rows):
    """The markdown table of bench-gemm JSON rows, one line per case (rounds of a case folded)."""
    cases = {}
    for r in rows:
        key = (r["model"], r["fc"], r["experts"], r["tokens_per_expert"], r["layout"], r["tiles"])
        cases.setdefault(key, []).append(r)
    out = ["| model | fc | E | rows/E | tiles | rounds | kernel µs, median (range) | TFLOP/s | weights TB/s "
           "| cuBLASLt kernel µs / TFLOP/s | ratio | target: met? |",
           "| --- | --- | ---: | ---: | --- | ---: | --- | ---: | ---: | --- | ---: | --- |"]
    order = {"fc1": 0, "fc1+swiglu": 1, "fc2": 2}
    keys = sorted(cases, key=lambda c: (c[0], c[2], c[3], order.get(c[1], 3)))  # model, E, rows, fc
    for (model, fc, experts, rows_per_expert, layout, tiles) in keys:
        rs = cases[(model, fc, experts, rows_per_expert, layout, tiles)]
        ks = [r["kernel_us_median"] for r in rs]
        k = statistics.median(ks)
        flops = rs[0]["tflops"] * rs[0]["us_median"]  # TFLOP/s x µs: the case's FLOPs / 1e6
        tf = flops / k
        gbs = rs[0]["weight_gbs_kernel"] * rs[0]["kernel_us_median"] / k
        cub = [r["cublas_kernel_us"] for r in rs if r.get("cublas_kernel_us", 0) > 0]
        if cub:
            c = statistics.median(cub)
            peer, ratio = f"{c:.1f} / {flops / c:.0f}", f"{c / k:.2f}"
        else:
            peer, ratio = "–", "–"
        verdicts = []
        for label, value, unit in targets(model, experts, rows_per_expert, fc):
            got = gbs if unit == "GB/s" else tf
            verdicts.append(f"≥ {label}: {'yes' if got >= value else 'no'}")
        span = f"{k:.1f} ({min(ks):.1f}-{max(ks):.1f})" if len(ks) > 1 else f"{k:.1f}"
        out.append(f"| {model} | {fc} | {experts} | {rows_per_expert} | {layout} {tiles} | {len(rs)} | {span} "
                   f"| {tf:.0f} | {gbs / 1000:.2f} | {peer} | {ratio} | {'; '.join(verdicts)} |")
    return out


def main(paths):
    rows = []
    for path in paths:
        doc = json.load(open(path))
        rows += doc.get("rows", []) if isinstance(doc, dict) else doc
    print("\n".join(table_lines(rows)))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
