"""bench_kstime.py: where the K-sliced GEMM's time goes at 1-16 tokens (experiment; global-timer stamps).

    python bench_kstime.py [M ...]

A copy of kernels._nvfp4_mm_ks_kernel that reads the global timer at its start, after its K loop and after its
store, and its SM id; and the read-floor kernel likewise. Each case is a CUDA graph of 8 calls on rotating weights,
each call with its own stamp buffer; per call: the gap since the previous call's last program ended, the span from
its first program's start to its last program's end, when its last program started, the median program's
duration, K loop and store, and programs per SM. The graph time per call (no stamps) is printed beside it.
"""
import statistics
import sys

import torch
import triton
import triton.language as tl

import bench
import kernels
from kernels import _dequant_regs, _dot, _store


@triton.jit
def _stamp(st_ptr, j: tl.constexpr, p):
    ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [p], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(st_ptr + p * 4 + j, ns)


@triton.jit
def _ks_stamped(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, st_ptr, M, N, NP, K, KT, stride_xm, stride_ym,
                BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, STAMP: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    p = pid_m * tl.num_programs(0) + pid_n
    if STAMP:
        _stamp(st_ptr, 0, p)
    n = pid_n * BN + tl.arange(0, BN)
    m = pid_m * BM + tl.arange(0, BM)
    ks, kk = tl.arange(0, KS), tl.arange(0, 128)
    acc = tl.zeros((KS, BN, BM), dtype=tl.float32)
    for i in range(0, tl.cdiv(KT, KS)):
        t = i * KS + ks
        live = (t < KT)[:, None, None]
        wo = (t[:, None, None] * NP + n[None, :, None])
        words = tl.load(w_ptr + wo * 16 + tl.arange(0, 16)[None, None, :], mask=live, other=0)
        sc = tl.load(s_ptr + wo * 2 + tl.arange(0, 2)[None, None, :], mask=live, other=0)
        sw0, sw1 = tl.split(tl.reshape(sc, (KS * BN, 2)))
        wt = _dequant_regs(tl.reshape(words, (KS * BN, 16)), sw0, sw1, KS * BN, True)
        k = t[:, None, None] * 128 + kk[None, :, None]
        xt = tl.load(x_ptr + m[None, None, :] * stride_xm + k, mask=(m[None, None, :] < M) & (k < K), other=0.0)
        acc = _dot(tl.reshape(wt, (KS, BN, 128)), xt, acc, True)
    if STAMP:
        _stamp(st_ptr, 1, p)
    acc = tl.sum(acc, 0) * (2.0 ** 119 / tl.load(gs_ptr))
    _store(acc, n, m, M, N, y_ptr, y_ptr, y_ptr, y_ptr, stride_ym, 0, False, 0, True)
    if STAMP:
        _stamp(st_ptr, 2, p)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [p], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(st_ptr + p * 4 + 3, sm.to(tl.int64))


@triton.jit
def _read_stamped(w_ptr, s_ptr, out_ptr, st_ptr, NW, NS, PER_W, PER_S, BLOCK: tl.constexpr, STAMP: tl.constexpr):
    p = tl.program_id(0)
    if STAMP:
        _stamp(st_ptr, 0, p)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in tl.range(0, PER_W, BLOCK):
        o = p * PER_W + i + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + o, mask=o < NW, other=0)
    for i in tl.range(0, PER_S, BLOCK):
        o = p * PER_S + i + tl.arange(0, BLOCK)
        acc ^= tl.load(s_ptr + o, mask=o < NS, other=0)
    if STAMP:
        _stamp(st_ptr, 1, p)
    tl.store(out_ptr + p, tl.sum(acc))
    if STAMP:
        _stamp(st_ptr, 2, p)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [p], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(st_ptr + p * 4 + 3, sm.to(tl.int64))


def ks_call(x, w, y, st, cfg, stamp):
    M, K = x.shape
    BM, BN = cfg["BM"], cfg["BN"]
    _ks_stamped[(-(-w.n // BN), -(-M // BM))](x, w.words, w.scales, w.global_scale, y, st, M, w.n,
                                              w.words.shape[1], K, w.words.shape[0], x.stride(0), y.stride(0),
                                              BM=BM, BN=BN, KS=cfg["KS"], STAMP=stamp, num_warps=cfg["num_warps"],
                                              num_stages=cfg["num_stages"])


def read_call(w, out, st, cfg, stamp):
    P, BLOCK = cfg["P"], cfg["BLOCK"]
    NW, NS = w.words.numel(), w.scales.numel()
    pw, ps = -(-NW // P // BLOCK) * BLOCK, -(-NS // P // BLOCK) * BLOCK
    _read_stamped[(P,)](w.words, w.scales, out, st, NW, NS, pw, ps, BLOCK=BLOCK, STAMP=stamp, num_warps=8,
                        num_stages=cfg["stages"])


def timeline(make_call, programs, calls=8):
    """make_call(i, st) -> closure; stamps of `calls` calls captured in one graph, replayed 3 times."""
    sts = [torch.zeros(programs, 4, dtype=torch.int64, device="cuda") for _ in range(calls)]
    fs = [make_call(i, sts[i]) for i in range(calls)]
    for f in fs:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fs:
            f()
    rows = []
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        t = [s.double().cpu() for s in sts]
        for i in range(1, calls):
            a, b = t[i - 1], t[i]
            t0 = b[:, 0].min()
            dur = b[:, 2] - b[:, 0]
            sms = torch.bincount(b[:, 3].long())
            rows.append(dict(gap=(t0 - a[:, 2].max()).item() / 1e3, span=(b[:, 2].max() - t0).item() / 1e3,
                             last_start=(b[:, 0].max() - t0).item() / 1e3,
                             med_start=(b[:, 0].median() - t0).item() / 1e3,
                             dur=dur.median().item() / 1e3, dur_max=dur.max().item() / 1e3,
                             loop=(b[:, 1] - b[:, 0]).median().item() / 1e3,
                             store=(b[:, 2] - b[:, 1]).median().item() / 1e3,
                             sms=int((sms > 0).sum()), per_sm_max=int(sms.max())))
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def show(label, programs, graph_us, r):
    print(f"{label:44s} {programs:5d} progs  graph {graph_us:6.2f} us | gap {r['gap']:.2f}  span {r['span']:.2f}  "
          f"starts med/last {r['med_start']:.2f}/{r['last_start']:.2f}  prog med/max {r['dur']:.2f}/"
          f"{r['dur_max']:.2f} (loop {r['loop']:.2f}, store {r['store']:.2f})  SMs {r['sms']} (max {r['per_sm_max']})",
          flush=True)


def scale():
    """Time per byte as the row count N moves the programs per SM (K-sliced at M = 1, the dispatch at M = 16)."""
    print(torch.cuda.get_device_name())
    for K in (3584, 18944):
        for N in (2112, 3584, 4224, 4608, 6336, 8448):
            _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
            for M in (1, 16):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                us = bench.graph_time_us([lambda w=w: kernels.nvfp4_linear(x, w) for w in wq])
                cfg = kernels.mm_config(M, N, K)
                print(f"K={K:5d} N={N:5d} M={M:2d} {us:6.2f} us  {N * K * 9 / 16 / us / 1e3:6.0f} GB/s  {cfg}",
                      flush=True)
            del wq


@triton.jit
def _ks_balanced(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, NP, K, KT, stride_xm, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr):
    # the K-sliced kernel over P programs of about N / P rows each (a BN-row tile, the rows past its share masked):
    # every program, and so every SM, streams the same bytes
    p, P = tl.program_id(0), tl.num_programs(0)
    r0, r1 = (p * N) // P, ((p + 1) * N) // P
    n = r0 + tl.arange(0, BN)
    rm = (n < r1)[None, :, None]
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    ks, kk = tl.arange(0, KS), tl.arange(0, 128)
    acc = tl.zeros((KS, BN, BM), dtype=tl.float32)
    for i in range(0, tl.cdiv(KT, KS)):
        t = i * KS + ks
        live = (t < KT)[:, None, None] & rm
        wo = (t[:, None, None] * NP + n[None, :, None])
        words = tl.load(w_ptr + wo * 16 + tl.arange(0, 16)[None, None, :], mask=live, other=0)
        sc = tl.load(s_ptr + wo * 2 + tl.arange(0, 2)[None, None, :], mask=live, other=0)
        sw0, sw1 = tl.split(tl.reshape(sc, (KS * BN, 2)))
        wt = _dequant_regs(tl.reshape(words, (KS * BN, 16)), sw0, sw1, KS * BN, True)
        k = t[:, None, None] * 128 + kk[None, :, None]
        xt = tl.load(x_ptr + m[None, None, :] * stride_xm + k, mask=(m[None, None, :] < M) & (k < K), other=0.0)
        acc = _dot(tl.reshape(wt, (KS, BN, 128)), xt, acc, True)
    acc = tl.sum(acc, 0) * (2.0 ** 119 / tl.load(gs_ptr))
    tl.store(y_ptr + m[None, :] * stride_ym + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(n[:, None] < r1) & (m[None, :] < M))


def bal_call(x, w, y, P, BN, stages):
    M, K = x.shape
    BM = max(1, 1 << (M - 1).bit_length())
    _ks_balanced[(P, -(-M // BM))](x, w.words, w.scales, w.global_scale, y, M, w.n, w.words.shape[1], K,
                                   w.words.shape[0], x.stride(0), y.stride(0), BM=BM, BN=BN, KS=4, num_warps=4,
                                   num_stages=stages)


def balanced(Ms):
    """The balanced K-sliced kernel against the dispatch, same run (paired), bits checked against it at M = 1."""
    print(torch.cuda.get_device_name())
    for name, (N, K) in bench.SHAPES_7B.items():
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ref = kernels.nvfp4_linear(x, wq[0]).float()
            for P, BN, stages in ((132, 64, 4), (264, 32, 4), (264, 32, 6), (396, 16, 4), (396, 32, 4),
                                  (528, 16, 4), (792, 16, 4)):
                if -(-N // P) > BN:
                    continue
                bal_call(x, wq[0], y, P, BN, stages)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                t_d, t_b = bench.paired_us([lambda w=w: kernels.nvfp4_linear(x, w) for w in wq],
                                           [lambda w=w: bal_call(x, w, y, P, BN, stages) for w in wq])
                print(f"{name:7s} M={M:2d} P={P:3d} BN={BN} S={stages}: dispatch {t_d:6.2f} us, balanced {t_b:6.2f} us "
                      f"({t_d / t_b:.3f}x)  err {err:.1e}", flush=True)
        del wq


def slices_per_warp(Ms):
    """K-sliced configs with 2-4 slices a warp (more K tiles a warp an iteration), against the dispatch (paired)."""
    print(torch.cuda.get_device_name())
    for name, (N, K) in bench.SHAPES_7B.items():
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = kernels.nvfp4_linear(x, wq[0]).float()
            BM = 1 << (M - 1).bit_length()
            for BN, KS, nw, st in ((16, 8, 4, 2), (16, 8, 4, 3), (16, 8, 4, 4), (32, 8, 4, 3), (16, 4, 2, 4),
                                   (16, 8, 2, 3), (16, 16, 4, 2), (32, 4, 4, 4), (16, 4, 4, 4)):
                cfg = dict(BM=BM, BN=BN, KS=KS, num_warps=nw, num_stages=st)
                try:
                    y = kernels.nvfp4_mm(x, wq[0], config=cfg).float()
                except Exception as e:
                    print(f"{name} M={M} {cfg}: {type(e).__name__}")
                    continue
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                t_d, t_c = bench.paired_us([lambda w=w: kernels.nvfp4_linear(x, w) for w in wq],
                                           [lambda w=w: kernels.nvfp4_mm(x, w, config=cfg) for w in wq])
                print(f"{name:7s} M={M:2d} BN={BN} KS={KS:2d} warps={nw} S={st}: dispatch {t_d:6.2f} us, "
                      f"this {t_c:6.2f} us ({t_d / t_c:.3f}x)  err {err:.1e}", flush=True)
        del wq


def main():
    if sys.argv[1:2] == ["spw"]:
        return slices_per_warp([int(a) for a in sys.argv[2:]] or [1, 8, 16])
    if sys.argv[1:2] == ["scale"]:
        return scale()
    if sys.argv[1:2] == ["balanced"]:
        return balanced([int(a) for a in sys.argv[2:]] or [1, 4, 8, 16])
    Ms = [int(a) for a in sys.argv[1:]] or [1, 16]
    print(torch.cuda.get_device_name())
    for name, (N, K) in bench.SHAPES_7B.items():
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        out = torch.empty(4096, dtype=torch.int32, device="cuda")
        dummy = torch.zeros(4096, 4, dtype=torch.int64, device="cuda")
        for P, BLOCK, stages in ((1056, 1024, 3), (1056, 1024, 4), (2112, 2048, 4), (264, 1024, 4), (528, 1024, 6)):
            cfg = dict(P=P, BLOCK=BLOCK, stages=stages)
            us = bench.graph_time_us([lambda w=w: read_call(w, out, dummy, cfg, False) for w in wq])
            r = timeline(lambda i, st: (lambda: read_call(wq[i % len(wq)], out, st, cfg, True)), P)
            show(f"{name} read floor {cfg}", P, us, r)
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            us = bench.graph_time_us([lambda w=w: kernels.nvfp4_linear(x, w) for w in wq])
            print(f"{name} M={M} dispatch {kernels.mm_config(M, N, K)}: {us:.2f} us")
            base = dict(BM=1 << (M - 1).bit_length(), KS=4, num_warps=4)
            for extra in (dict(BN=16, num_stages=4), dict(BN=32, num_stages=4), dict(BN=16, num_stages=8),
                          dict(BN=16, num_stages=2), dict(BN=16, KS=8, num_warps=8, num_stages=4),
                          dict(BN=64, num_stages=4)):
                cfg = {**base, **extra}
                P = -(-N // cfg["BN"]) * -(-M // cfg["BM"])
                us = bench.graph_time_us([lambda w=w: ks_call(x, w, y, dummy, cfg, False) for w in wq])
                r = timeline(lambda i, st: (lambda: ks_call(x, wq[i % len(wq)], y, st, cfg, True)), P)
                show(f"{name} M={M} ks {extra}", P, us, r)


if __name__ == "__main__":
    main()
