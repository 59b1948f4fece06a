"""bench.py: the GPU measurements behind the README's results table (random weights of real shapes).

    python bench.py kernels                 # NVFP4 GEMM vs torch bf16 at the Qwen2.5-7B linear shapes, dgrad, RMSNorm
    python bench.py kernels --sweep         # also try the candidate tile configs per (shape, M) and print the best

Timing: CUDA graphs of many calls (launch gaps excluded), the median of several replays; weights are rotated over
enough copies that every call reads them from HBM, not L2 (50 MB). Speedups are ours / torch bf16 measured in the
same run. Needs a CUDA GPU.
"""
import argparse
import json
import math
import statistics
import sys

import torch

SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
L2_BYTES = 50 * 2**20


def graph_time_us(calls, reps: int = 5, replays: int = 7) -> float:
    """Median microseconds per call of `calls` (a list of closures), captured in one CUDA graph."""
    for f in calls:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in calls:
                f()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (reps * len(calls)))
    del g
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(3 * L2_BYTES / nbytes))


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (GB/s)."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)], reps=3)
    return 2 * src.numel() * 4 / us / 1e3


def random_nvfp4(N, K, copies):
    import kernels
    import quantize

    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, scale, gs = quantize.quantize_weight(w)
    base = kernels.pack_nvfp4(packed, scale, gs.cuda())
    ws = [base] + [kernels.NVFP4Weight(base.words.clone(), base.scales.clone(), base.global_scale.clone(), N, K)
                   for _ in range(copies - 1)]
    return w, ws


def bench_gemm(Ms, sweep: bool, out: dict):
    import kernels

    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s")
    out["copy_GBps"] = bw
    rows, best_cfgs = [], {}
    for name, (N, K) in SHAPES_7B.items():
        w_bf16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wb = [w_bf16] + [w_bf16.clone() for _ in range(copies_for(N * K * 2) - 1)]
        _, wq = random_nvfp4(N, K, copies_for(N * K * 9 // 16))
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_bf16 = graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb])
            t_ours = graph_time_us([lambda w=w: kernels.nvfp4_linear(x, w) for w in wq])
            gbs = N * K * 9 / 16 / t_ours / 1e3
            row = dict(shape=name, M=M, bf16_us=t_bf16, nvfp4_us=t_ours, speedup=t_bf16 / t_ours, nvfp4_GBps=gbs)
            if sweep and M < kernels.LARGE_M:
                cands = sweep_configs(M, N, K)
                res = []
                for cfg in cands:
                    try:
                        t = graph_time_us([lambda w=w, c=cfg: kernels.nvfp4_mm(x, w, config=c) for w in wq], reps=3)
                    except Exception as e:  # a config that does not fit (shared memory) is skipped
                        print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    res.append((t, cfg))
                res.sort(key=lambda r: r[0])
                row["best_cfg"], row["best_us"] = res[0][1], res[0][0]
                row["sweep"] = [(round(t, 2), c) for t, c in res[:5]]
                best_cfgs[f"{name}/{M}"] = res[0][1]
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "sweep"}))
            sys.stdout.flush()
    out["gemm"] = rows
    if sweep:
        out["best_cfgs"] = best_cfgs
    print(f"\n| M | " + " | ".join(SHAPES_7B) + " | geomean |\n|---|" + "---|" * (len(SHAPES_7B) + 1))
    for M in Ms:
        sp = [r["speedup"] for r in rows if r["M"] == M]
        print(f"| {M} | " + " | ".join(f"{s:.2f}x" for s in sp) + f" | {math.exp(sum(map(math.log, sp)) / len(sp)):.2f}x |")
    return rows


def sweep_configs(M, N, K):
    BMs = [16] if M <= 16 else [32] if M <= 32 else [64] if M <= 64 else [128, 256]
    out = []
    for BM in BMs:
        for BN in (64, 128):
            for split in (1, 2, 4, 8, 16):
                if (K // 128) // split < 2:
                    continue
                if -(-N // BN) * -(-M // BM) * split > 10 * 132:
                    continue
                for stages, unroll in (((3, 1), (3, 2), (4, 2)) if BM <= 64 else ((2, 1), (3, 1))):
                    nw = 4 if BN == 64 else 8
                    out.append(dict(BM=BM, BN=BN, SPLIT_K=split, num_warps=nw, num_stages=stages, UNROLL=unroll))
    return out


def bench_dgrad(out: dict):
    import kernels

    rows = []
    for name, (N, K) in SHAPES_7B.items():
        _, (wq,) = random_nvfp4(N, K, 1)
        wb = kernels.dequantize(wq)
        for M in (4096, 16384):
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            t_bf16 = graph_time_us([lambda: dy @ wb], reps=2, replays=5)
            t_ours = graph_time_us([lambda: dy @ kernels.dequantize(wq)], reps=2, replays=5)
            t_deq = graph_time_us([lambda: kernels.dequantize(wq)], reps=3)
            rows.append(dict(shape=name, M=M, bf16_us=t_bf16, nvfp4_us=t_ours, ratio=t_bf16 / t_ours,
                             dequant_us=t_deq, dequant_GBps=N * K * (2 + 9 / 16) / t_deq / 1e3))
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
    out["dgrad"] = rows


def bench_rmsnorm(out: dict):
    import kernels

    rows = []
    M = 16384
    for H in (3584, 5120):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(H, device="cuda") * 0.01
        t_f = graph_time_us([lambda: kernels.rms_norm(x, w, 1e-6, z)], reps=5)
        t_fr = graph_time_us([lambda: kernels.rms_norm(x, w, 1e-6, z, r)], reps=5)
        xg = x.clone().requires_grad_(True)
        y = kernels.rms_norm(xg, w, 1e-6, z)
        dy = torch.randn_like(y)
        import triton.testing  # autograd cannot be captured in a graph; this kernel is long enough for events
        t_b = 1e3 * triton.testing.do_bench(lambda: torch.autograd.grad(y, xg, dy, retain_graph=True),
                                            return_mode="median")
        t_ref = graph_time_us([lambda: kernels.rms_norm_ref(x, w, 1e-6, z)], reps=5)
        nb = M * H * 2
        rows.append(dict(H=H, M=M, fwd_GBps=2 * nb / t_f / 1e3, fwd_res_GBps=4 * nb / t_fr / 1e3,
                         bwd_GBps=3 * nb / t_b / 1e3, fwd_us=t_f, bwd_us=t_b, torch_ref_fwd_us=t_ref))
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
    out["rmsnorm"] = rows


def run_one(shape: str, M: int, config: str | None, iters: int):
    """A few plain calls of one GEMM, for profilers: ncu -k regex:nvfp4 python bench.py one --shape gate_up --m 1"""
    import kernels

    N, K = SHAPES_7B[shape]
    _, (w,) = random_nvfp4(N, K, 1)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    cfg = json.loads(config) if config else None
    for _ in range(iters):
        kernels.nvfp4_mm(x, w, config=cfg)
    torch.cuda.synchronize()
    print(f"ran {iters} x {shape} M={M} config={cfg or kernels.mm_config(M, N, K)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description="nanoqerl GPU benchmarks (print measured numbers; need a CUDA GPU).")
    ap.add_argument("what", choices=["kernels", "one"], help="kernels: the tables; one: a single GEMM (for profilers)")
    ap.add_argument("--shape", default="gate_up", choices=sorted(SHAPES_7B), help="with `one`: the 7B linear shape")
    ap.add_argument("--config", default=None, help="with `one`: a JSON tile config (default: the dispatch table)")
    ap.add_argument("--iters", type=int, default=3, help="with `one`: calls to make")
    ap.add_argument("--sweep", action="store_true", help="also time the candidate GEMM configs per (shape, M)")
    ap.add_argument("--m", default="1,16,64,256,4096", help="token counts M for the GEMM table")
    ap.add_argument("--parts", default="gemm,dgrad,rmsnorm", help="which kernel benchmarks to run (comma list)")
    ap.add_argument("--json", default=None, help="also write all numbers to this JSON file")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    if not torch.cuda.is_available():
        print("error: bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.what == "one":
        return run_one(args.shape, int(args.m.split(",")[0]), args.config, args.iters) or 0
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = args.parts.split(",")
    if "gemm" in parts:
        bench_gemm([int(m) for m in args.m.split(",")], args.sweep, out)
    if "dgrad" in parts:
        bench_dgrad(out)
    if "rmsnorm" in parts:
        bench_rmsnorm(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
