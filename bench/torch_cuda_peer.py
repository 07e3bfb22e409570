#!/usr/bin/env python3
"""PyTorch's side of the GPU benchmark (bench/run_cuda_bench.sh), on the same GPU in the same run:
device copy bandwidth, f16 GEMV (M=1) at 16384^2 and 4096^2, f16 GEMM at 8192^3 (cuBLAS through
torch.matmul), and nanoGPT-style generation (full forward over the cropped context each token,
no KV cache: the eager-PyTorch baseline the issue names) for the bundled model's config.
Prints `peer=torch mode=... key=value` lines. Timing: CUDA events, median of N after warm-up."""
import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def median_ms(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_copy(iters):
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), iters)
    print(f"peer=torch mode=copy bytes={n} ms={ms:.4f} gbs={2 * n / ms / 1e6:.1f}", flush=True)


def bench_gemv(n, iters):
    # nn.Linear's layout: W[N, K]; x[1, K]. Enough copies (>= 1 GiB) to miss the 60 MB L2.
    wbytes = n * n * 2
    copies = max(2, min(64, (1 << 30) // wbytes + 1))
    ws = [torch.empty(n, n, dtype=torch.float16, device="cuda").uniform_(-0.2, 0.2)
          for _ in range(copies)]
    x = torch.empty(1, n, dtype=torch.float16, device="cuda").uniform_(-1, 1)
    i = [0]

    def step():
        F.linear(x, ws[i[0] % copies])
        i[0] += 1

    ms = median_ms(step, iters)
    print(f"peer=torch mode=gemv dtype=f16 K={n} N={n} copies={copies} us={ms * 1e3:.2f} "
          f"weight_bytes={wbytes} gbs={wbytes / ms / 1e6:.1f}", flush=True)

    # The kernels alone: one GEMV per copy recorded into a CUDA graph, the replay's median over
    # the copies (no per-call dispatch or launch from the host; ptllm's gemv_graph is the same).
    y = torch.empty(1, n, dtype=torch.float16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in ws:
            torch.matmul(x, w.t(), out=y)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            torch.matmul(x, w.t(), out=y)
    ms = median_ms(g.replay, iters) / copies
    print(f"peer=torch mode=gemv_graph dtype=f16 K={n} N={n} copies={copies} us={ms * 1e3:.2f} "
          f"weight_bytes={wbytes} gbs={wbytes / ms / 1e6:.1f}", flush=True)


def bench_gemm(n, iters):
    a = torch.empty(n, n, dtype=torch.float16, device="cuda").uniform_(-1, 1)
    b = torch.empty(n, n, dtype=torch.float16, device="cuda").uniform_(-1, 1)
    ms = median_ms(lambda: torch.matmul(a, b), iters)
    print(f"peer=torch mode=gemm dtype=f16 M={n} N={n} K={n} ms={ms:.3f} "
          f"tflops={2 * n ** 3 / ms / 1e9:.1f}", flush=True)


class Block(nn.Module):
    def __init__(self, c, nh):
        super().__init__()
        self.nh = nh
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.c_fc_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.c_fc_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, n_embd):
        super().__init__()
        self.block = block
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.T  # tied head

    @torch.no_grad()
    def generate(self, idx, tokens):
        for _ in range(tokens):
            logits = self(idx[:, -self.block:])[:, -1, :]
            idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)  # greedy
        return idx


def bench_sample(tokens, n_layer, n_head, n_embd, block, vocab, repeats):
    """Greedy generation of `tokens` after a 6-token prompt, timed `repeats` times (the median is
    tok_s, as ptllm's `bench sample --repeats` reports its median)."""
    torch.manual_seed(0)
    m = GPT(vocab, block, n_layer, n_head, n_embd).cuda().eval()
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]], device="cuda")
    m.generate(prompt, 5)  # warm-up
    torch.cuda.synchronize()
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m.generate(prompt, tokens)
        torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
    med = statistics.median(secs)
    params = sum(p.numel() for p in m.parameters()) - m.wpe.weight.numel()
    print(f"peer=torch mode=sample device=cuda n_layer={n_layer} n_head={n_head} n_embd={n_embd} "
          f"block={block} params={params} tokens={tokens} repeats={repeats} secs={med:.4f} "
          f"secs_min={min(secs):.4f} secs_max={max(secs):.4f} tok_s={tokens / med:.2f} "
          f"tok_s_best={tokens / min(secs):.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--repeats", type=int, default=5, help="timed generations (median reported)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name(0)}", flush=True)
    bench_copy(a.iters)
    for n in (16384, 4096):
        bench_gemv(n, a.iters)
    if not a.no_gemm:
        bench_gemm(8192, max(5, a.iters // 4))
    bench_sample(a.tokens, 4, 4, 256, 256, 65, max(1, a.repeats))


if __name__ == "__main__":
    main()
