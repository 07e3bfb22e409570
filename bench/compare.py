#!/usr/bin/env python3
"""Reads peer= lines (ours: peer=ptllm, theirs: peer=torch / peer=membw) and prints medians and
the ratios the issues ask for, measured side by side in one run."""
import re
import statistics
import sys
from collections import defaultdict


def parse(path):
    rows = []
    for line in open(path, encoding="utf-8"):
        if line.startswith("peer="):
            rows.append(dict(kv.split("=", 1) for kv in line.split() if "=" in kv))
    return rows


def med(rows, key, **match):
    vals = [float(r[key]) for r in rows if all(r.get(k) == str(v) for k, v in match.items()) and key in r]
    return (statistics.median(vals), len(vals)) if vals else (None, 0)


def main():
    rows = parse(sys.argv[1])
    print("# summary: medians over repetitions; ratio = ours / peer (higher is better)")
    configs = {"small": dict(n_embd="128", block="64"), "bundled": dict(n_embd="256", block="256")}
    for name, m in configs.items():
        for mode in ("train", "sample"):
            torch, nt = med(rows, "tok_s", peer="torch", mode=mode, **m)
            if torch is None:
                continue
            for path in ("f32", "f16-storage"):
                ours, n = med(rows, "tok_s", peer="ptllm", mode=mode, path=path, **m)
                if ours is not None:
                    print(f"{name:8s} {mode:6s} path={path:12s} ptllm={ours:10.1f} tok/s  "
                          f"torch={torch:10.1f} tok/s  ratio={ours / torch:6.2f}x  (n={n},{nt})")
    read_gbs = defaultdict(list)
    for r in rows:
        if r.get("peer") == "membw":
            read_gbs[r.get("threads")].append(float(r["read_gbs"]))
    mm = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("peer") == "ptllm" and r.get("mode") == "matmul":
            key = (r["M"], r["K"], r["N"], r["threads"])
            for k in ("f16_speedup", "f16_weight_gbs", "f32_weight_gbs", "f32_gflops", "f16_gflops"):
                mm[key][k].append(float(r[k]))
    for (M, K, N, th), d in mm.items():
        line = (f"matmul M={M} K={K} N={N}: f16/f32 speedup {statistics.median(d['f16_speedup']):.2f}x, "
                f"f16 {statistics.median(d['f16_gflops']):.1f} GFLOP/s, f32 {statistics.median(d['f32_gflops']):.1f} GFLOP/s")
        if M == "1" and read_gbs.get(th):
            bw = statistics.median(read_gbs[th])
            g16 = statistics.median(d["f16_weight_gbs"])
            line += f", f16 reads {g16:.1f} GB/s = {100 * g16 / bw:.0f}% of membw read {bw:.1f} GB/s ({th} threads)"
        print(line)
    ceiling, _ = med(rows, "gflops", peer="ptllm", mode="fma_ceiling")
    gemm = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("mode") == "gemm":
            for k in ("warm_gflops", "cold_gflops"):
                gemm[(r["layer"], r["op"], r["M"], r["K"], r["N"])][(r["peer"], k)].append(float(r[k]))
    if gemm and ceiling:
        print(f"GEMMs of the bundled training step, GFLOP/s (median), FMA ceiling {ceiling:.1f} GFLOP/s:")
    for (layer, op, M, K, N), d in gemm.items():
        cell = {pk: statistics.median(v) for pk, v in d.items()}
        ours = cell.get(("ptllm", "cold_gflops"))
        blas = cell.get(("openblas", "cold_gflops"))
        line = f"  {layer:6s} {op} {M}x{K}x{N}:"
        if ours is not None:
            line += f" ptllm warm {cell[('ptllm', 'warm_gflops')]:6.1f} cold {ours:6.1f}"
            if ceiling:
                line += f" ({100 * ours / ceiling:.0f}% of ceiling)"
        if blas is not None:
            line += f"  openblas cold {blas:6.1f}"
            if ours is not None:
                line += f"  ratio {ours / blas:.2f}x"
        print(line)
    step, _ = med(rows, "cold_ms", peer="ptllm", mode="gemm_step")
    floor, _ = med(rows, "ceiling_ms", peer="ptllm", mode="gemm_step")
    if step and floor:
        print(f"  the step's GEMMs: {step:.1f} ms cold, {floor:.1f} ms at the FMA ceiling")
    gates = [float(r["all_gates_ms"]) for r in rows if r.get("mode") == "gates"]
    if gates:
        print(f"all gates at startup: {statistics.median(gates):.2f} ms (median of {len(gates)})")


if __name__ == "__main__":
    main()
