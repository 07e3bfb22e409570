#!/usr/bin/env python3
"""Ratios of the GPU benchmark's peer= lines (bench/run_cuda_bench.sh) against the issue's goals."""
import sys


def parse(path):
    rows = []
    for line in open(path):
        if line.startswith("peer="):
            rows.append(dict(kv.split("=", 1) for kv in line.split() if "=" in kv))
    return rows


def pick(rows, **want):
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def main():
    rows = parse(sys.argv[1])
    out = []
    tc = pick(rows, peer="torch", mode="copy")
    oc = pick(rows, peer="ptllm", mode="copy")
    copy = float((tc or oc)["gbs"]) if (tc or oc) else None
    if tc and oc:
        out.append(f"copy bandwidth: ptllm {float(oc['gbs']):.0f} GB/s, torch {float(tc['gbs']):.0f} GB/s")
    for n, goal in (("16384", None), ("4096", None)):
        t = pick(rows, peer="torch", mode="gemv", K=n)
        o = pick(rows, peer="ptllm", mode="gemv", path="f16-storage", K=n)
        f = pick(rows, peer="ptllm", mode="gemv", path="f32", K=n)
        if not (t and o):
            continue
        ratio = float(t["us"]) / float(o["us"])
        line = (f"f16-storage GEMV {n}^2: {float(o['gbs']):.0f} GB/s ({o['us']} us) vs torch f16 "
                f"{float(t['gbs']):.0f} GB/s ({t['us']} us): {ratio:.2f}x torch")
        if f:
            line += f", {float(f['us']) / float(o['us']):.2f}x our f32"
        if copy:
            line += f", {float(o['gbs']) / copy * 100:.0f}% of copy bandwidth"
        if n == "16384":
            line += f"  [goal >= 3700 GB/s: {'met' if float(o['gbs']) >= 3700 else 'NOT met'}]"
        else:
            line += f"  [goal >= 2x torch: {'met' if ratio >= 2 else 'NOT met'}]"
        out.append(line)
        tg = pick(rows, peer="torch", mode="gemv_graph", K=n)
        og = pick(rows, peer="ptllm", mode="gemv_graph", path="f16-storage", K=n)
        if tg and og:
            out.append(f"    kernels alone (graph replay): ours {og['us']} us ({float(og['gbs']):.0f} GB/s) "
                       f"vs torch {tg['us']} us ({float(tg['gbs']):.0f} GB/s): "
                       f"{float(tg['us']) / float(og['us']):.2f}x")
        for r in rows:
            if r.get("peer") == "ptllm" and r.get("mode") == "gemv" and r.get("K") == n \
                    and r["path"] not in ("f16-storage",):
                out.append(f"    {r['path']:<16} gate={r['gate']:<9} {float(r['gbs']):7.0f} GB/s  {r['us']} us")
        for r in rows:
            if r.get("peer") == "ptllm" and r.get("mode") == "gemv_variant" and r.get("K") == n:
                out.append(f"    f16 schedule {r['variant']:<18} bit_identical={r['bit_identical']} "
                           f"{float(r['gbs']):7.0f} GB/s  {r['us']} us")
    g = pick(rows, peer="ptllm", mode="gemm")
    tg = pick(rows, peer="torch", mode="gemm")
    if g:
        line = (f"tensor-core GEMM 8192^3: ours {g['ours_tflops']} TFLOP/s, cuBLASLt "
                f"{g['cublaslt_tflops']} TFLOP/s: {float(g['ours_over_cublaslt']) * 100:.0f}% of cuBLASLt")
        if tg:
            line += f", {float(g['ours_tflops']) / float(tg['tflops']) * 100:.0f}% of torch f16 ({tg['tflops']})"
        line += f"  [goal >= 80%: {'met' if float(g['ours_over_cublaslt']) >= 0.8 else 'NOT met'}]"
        out.append(line)
    ts = pick(rows, peer="torch", mode="sample")
    samples = [r for r in rows if r.get("peer") == "ptllm" and r.get("mode") == "sample"]
    torch_spread = ""
    if ts and "tok_s_best" in ts:  # the peer's median of several generations, and its best
        torch_spread = f" (median of {ts.get('repeats', '?')}, best {float(ts['tok_s_best']):.0f})"
    for s in samples:
        if ts:
            ratio = float(s["tok_s"]) / float(ts["tok_s"])
            form = ""
            if s.get("device") == "cuda":
                fused = int(s.get("fused_blocks", "0"))
                ff = s.get("fused_form", "0")
                form = f" step={'fused form ' + (ff if ff != '0' else 'default') + ' x' + str(fused) + ' blocks' if fused else 'op kernels'}"
                if s.get("step_form") == "auto":
                    form += " (default: the fastest form)"
                if s.get("greedy_graph") == "0":
                    form += " (no greedy run graph)"
                if s.get("weights") == "checkpoint":
                    form += " [bundled checkpoint]"
                if int(s.get("spec_lanes", "0")) > 1:
                    form += (f" speculative x{s['spec_lanes']} lanes "
                             f"({float(s.get('spec_tokens_per_step', 0)):.2f} tokens/step)")
            us = f" ({float(s['us_token']):.1f} us/token)" if "us_token" in s else ""
            out.append(f"decode bundled config, path={s.get('path')} device={s.get('device', '?')}{form}: "
                       f"{float(s['tok_s']):.0f} tok/s{us} vs torch generate {float(ts['tok_s']):.0f} "
                       f"tok/s{torch_spread}: {ratio:.1f}x  [goal >= 20x: {'met' if ratio >= 20 else 'NOT met'}]")
    print("\n".join(out))


if __name__ == "__main__":
    main()
