"""bench/kernel_speed.py: `python -m bench kernels`: the NVFP4 GEMM against torch bf16 at the
Qwen2.5-7B (or 32B) linear shapes, the dgrad and the noisy RMSNorm (the other --parts are in
bench/sweep.py).

At M <= 64 the GEMM table also times cuBLAS bf16 on a weight of as many bytes as the NVFP4 one
(9/32 of the rows: "same-bytes bound") and a kernel that only streams the NVFP4 words and scales
("read floor", an estimate).
Speedups are ours / torch bf16 measured in the same run. Needs a CUDA GPU.
"""
import json
import math
import sys

import torch

from bench.common import (SHAPES_7B, copies_for, copy_bandwidth, graph_time_us, paired_us,
                          random_nvfp4)
from bench.sweep import precompile, read_floor_us, sweep_configs


def bench_gemm(Ms, sweep: str | None, out: dict, shapes: dict = SHAPES_7B):

    import kernels

    out["copy_GBps"] = bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s")
    out["path"] = path = "hopper" if kernels.hopper(torch.device("cuda")) else "portable"
    print(f"path: {path} ("
          + ("kernels_ws's GEMM where it wins at 33..1023 tokens, sm_90 PTX)" if path == "hopper"
             else "the Triton kernels only, the portable PTX: what non-Hopper GPUs run)"))
    rows, best_cfgs = [], {}
    if sweep:
        precompile([M for M in Ms if M < kernels.LARGE_M], 12, sweep, shapes)
    for name, (N, K) in shapes.items():
        w_bf16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wb = [w_bf16] + [w_bf16.clone() for _ in range(copies_for(N * K * 2) - 1)]
        _, wq = random_nvfp4(N, K, copies_for(N * K * 9 // 16))
        # a bf16 weight holding as many bytes as the NVFP4 one
        rows_eq = N * K * 9 // 16 // (2 * K)
        weq = [torch.randn(rows_eq, K, device="cuda", dtype=torch.bfloat16)
               for _ in range(copies_for(rows_eq * K * 2))]
        t_read = read_floor_us(wq) if min(Ms) <= 64 else None
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_bf16, t_ours = paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                       [lambda w=w: kernels.nvfp4_linear(x, w) for w in wq])
            gbs = N * K * 9 / 16 / t_ours / 1e3
            row = dict(shape=name, M=M, bf16_us=t_bf16, nvfp4_us=t_ours, speedup=t_bf16 / t_ours,
                       nvfp4_GBps=gbs,
                       gemm=("dequant+cuBLAS" if M >= kernels.LARGE_M
                             else "triton" if kernels.ws_choice(x, wq[0]) is None else "ws"))
            # the bound a perfect W4 kernel meets: cuBLAS reading as many bytes (9/32 of the rows)
            if M <= 64:
                t_eq = graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in weq])
                row.update(same_bytes_bf16_us=t_eq, bound_speedup=t_bf16 / t_eq,
                           read_floor_us=t_read, floor_speedup=t_bf16 / t_read)
            cands = sweep_configs(M, N, K, sweep) if sweep and M < kernels.LARGE_M else []
            if cands:  # (the ks family has none above 16 tokens)
                res = []
                for cfg in cands:
                    try:
                        t = graph_time_us([lambda w=w, c=cfg: kernels.nvfp4_mm(x, w, config=c)
                                           for w in wq], reps=3)
                    except Exception as e:  # a config that does not fit (shared memory) is skipped
                        print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    res.append((t, cfg))
                res.sort(key=lambda r: r[0])
                row["best_cfg"], row["best_us"] = res[0][1], res[0][0]
                row["sweep"] = [(round(t, 2), c) for t, c in res]
                best_cfgs[f"{name}/{M}"] = res[0][1]
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in row.items() if k != "sweep"}))
            sys.stdout.flush()
    out["gemm"] = rows
    if sweep:
        out["best_cfgs"] = best_cfgs
    print("\n| M | " + " | ".join(shapes) + " | geomean | same-bytes bound | read floor |\n|---|"
          + "---|" * (len(shapes) + 3))
    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    for M in Ms:
        sp = [r["speedup"] for r in rows if r["M"] == M]
        bd = [r["bound_speedup"] for r in rows if r["M"] == M and "bound_speedup" in r]
        fl = [r["floor_speedup"] for r in rows if r["M"] == M and "floor_speedup" in r]
        cells = [", ".join(f"{s:.2f}x" for s in v) + f" (geomean {gm(v):.2f}x)" if v else "-"
                 for v in (bd, fl)]
        bound = " | ".join(cells)
        print(f"| {M} | " + " | ".join(f"{s:.2f}x" for s in sp) + f" | {gm(sp):.2f}x | {bound} |")
    return rows


def bench_dgrad(out: dict):
    import kernels

    rows = []
    for name, (N, K) in SHAPES_7B.items():
        _, (wq,) = random_nvfp4(N, K, 1)
        wb = kernels.dequantize(wq)
        for M in (4096, 16384):
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            t_bf16, t_ours = paired_us([lambda: dy @ wb], [lambda: dy @ kernels.dequantize(wq)],
                                       reps=2, replays=5)
            t_deq = graph_time_us([lambda: kernels.dequantize(wq)], reps=3)
            rows.append(dict(shape=name, M=M, bf16_us=t_bf16, nvfp4_us=t_ours,
                             ratio=t_bf16 / t_ours, dequant_us=t_deq,
                             dequant_GBps=N * K * (2 + 9 / 16) / t_deq / 1e3))
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in rows[-1].items()}))
    out["dgrad"] = rows


def bench_rmsnorm(out: dict):
    from layers import ops

    rows = []
    M = 16384
    bw = out.get("copy_GBps") or copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s")
    for H in (3584, 5120):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(H, device="cuda") * 0.01
        t_f = graph_time_us([lambda: ops.rms_norm(x, w, 1e-6, z)], reps=5)
        t_fr = graph_time_us([lambda: ops.rms_norm(x, w, 1e-6, z, r)], reps=5)
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = ops.rms_norm(xg, wg, 1e-6, z)
        dy = torch.randn_like(y)
        # the autograd node of ops._RMSNorm: its backward (dX and dW) called directly, in a graph
        ctx = y.grad_fn
        assert type(ctx).__name__ == "_RMSNormBackward", type(ctx).__name__
        t_b = graph_time_us([lambda: ops._RMSNorm.backward(ctx, dy)], reps=5)
        t_ref = graph_time_us([lambda: ops.rms_norm_ref(x, w, 1e-6, z)], reps=5)
        nb = M * H * 2
        rows.append(dict(H=H, M=M, fwd_GBps=2 * nb / t_f / 1e3, fwd_res_GBps=4 * nb / t_fr / 1e3,
                         bwd_GBps=3 * nb / t_b / 1e3, fwd_us=t_f, bwd_us=t_b,
                         torch_ref_fwd_us=t_ref))
        rows[-1].update(fwd_of_copy=rows[-1]["fwd_GBps"] / bw,
                        bwd_of_copy=rows[-1]["bwd_GBps"] / bw)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                          for k, v in rows[-1].items()}))
    out["rmsnorm"] = rows
