"""kernels_dq.py (experiment, not used by the project): an NVFP4 x bf16 GEMM for Hopper where dequantization and
the tensor cores run in different warps. Tokens are the wgmma A operand (64 rows, from shared memory), the
dequantized weights the B operand (BN = 64 or 128 rows, written to shared memory by 4 dequantizing warps), so one
wgmma covers 64 x BN x 16 and the warp group that issues them does nothing else:

    word loader warp:  TMA words + scales of K tile i -> ring A stage i % SA          (aready / aempty)
    token loader warp: TMA tokens of K tile i -> ring X stage i % SX                  (xready / xempty)
    dequant warps:     words -> registers (stage released), bf16 q * s -> ring B stage i % SB, fence (bready / bempty)
    mma warp group:    8 wgmmas (64 x BN x 16) from rings X and B; tile i-1's done -> release its X and B stages

    python kernels_dq.py    # checks against the fp32 reference, then times against bf16 and kernels.nvfp4_linear

Measured on an H100 (one run): correct (max error / max |y| 0 .. 3.5e-3, bf16 rounding), but its best config per shape is 1.3-2.2x slower
than kernels.nvfp4_linear at 16 and 64 tokens on every 7B shape (gate_up at 64 tokens 78.8 vs 48.8 us; Nsight
Compute: tensor pipe 32% active, 0.33 instructions issued per cycle per scheduler). Every weight now also crosses
shared memory twice in bf16 (written, then read by the wgmma): about 6 bytes of shared-memory traffic per weight at
64 tokens against 2.5 with the weights in registers. 8 dequantizing warps gave wrong results and are refused.
"""
import torch

import kernels
import kernels_ws as W
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def _log2(v):
    return v.bit_length() - 1


def _layouts(BN, DW):
    # words (BN, 16) and scale words (BN, 2) for DW dequantizing warps: the per-warp pattern of kernels_ws._WL / _SL
    # (16 rows a warp), further rows in registers
    extra = [[16 * DW * 2 ** i, 0] for i in range(_log2(BN // (16 * DW)))]
    warps = [[16 * 2 ** i, 0] for i in range(_log2(DW))]
    wl = gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0], [0, 8]] + extra,
                                    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=warps, block_bases=[], shape=[BN, 16])
    sl = gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]] + extra,
                                    lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=warps, block_bases=[], shape=[BN, 2])
    return wl, sl


@gluon.jit
def _dequant(w_bufs, s_bufs, b_bufs, aready, aempty, bready, bempty, NT, BN: gl.constexpr, SA: gl.constexpr,
             SB: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr):
    for i in range(NT):
        s = i % SA
        mbarrier.wait(aready.index(s), (i // SA) & 1)
        words = w_bufs.index(s).load(WL)                                                  # (BN, 16) int32
        sw = s_bufs.index(s)._reinterpret(gl.int32, [BN, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(SL)
        mbarrier.arrive(aempty.index(s))                                                  # words in registers
        sw0, sw1 = gl.split(sw)
        sw0 = gl.convert_layout(sw0, gl.SliceLayout(1, WL), assert_trivial=True)
        sw1 = gl.convert_layout(sw1, gl.SliceLayout(1, WL), assert_trivial=True)
        mult = gl.inline_asm_elementwise(W._SCALE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [sw0, sw1],
                                         dtype=(gl.int32,) * 8, is_pure=True, pack=1)
        b = i % SB
        mbarrier.wait(bempty.index(b), ((i // SB) & 1) ^ 1)
        dst = b_bufs.index(b)
        for r in gl.static_range(8):
            q = W._block(words, mult[r], r)                                               # (BN, 16) bf16
            dst.slice(16 * r, 16, dim=1).store(q)
        fence_async_shared()
        mbarrier.arrive(bready.index(b))


@gluon.jit
def _wloader(w_desc, s_desc, w_bufs, s_bufs, aready, aempty, n0, NP, t0, NT, SA: gl.constexpr):
    nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes
    for j in range(NT):
        s, t = j % SA, t0 + j
        mbarrier.wait(aempty.index(s), ((j // SA) & 1) ^ 1)
        mbarrier.expect(aready.index(s), nbytes)
        tma.async_copy_global_to_shared(w_desc, [t * NP + n0, 0], aready.index(s), w_bufs.index(s))
        tma.async_copy_global_to_shared(s_desc, [(t * NP + n0) // 2, 0], aready.index(s), s_bufs.index(s))


@gluon.jit
def _xloader(x_desc, x_bufs, xready, xempty, m0, t0, NT, SX: gl.constexpr):
    for j in range(NT):
        s, t = j % SX, t0 + j
        mbarrier.wait(xempty.index(s), ((j // SX) & 1) ^ 1)
        mbarrier.expect(xready.index(s), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [m0, t * 128], xready.index(s), x_bufs.index(s))


@gluon.jit
def _mma(x_bufs, b_bufs, xready, xempty, bready, bempty, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, n0, m0, NT,
         stride_ym, BN: gl.constexpr, SX: gl.constexpr, SB: gl.constexpr, SPLIT: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros((64, BN), gl.float32, MMA)
    for i in range(NT):
        sx, b = i % SX, i % SB
        mbarrier.wait(xready.index(sx), (i // SX) & 1)
        mbarrier.wait(bready.index(b), (i // SB) & 1)
        xs = x_bufs.index(sx)
        bs = b_bufs.index(b)
        for r in gl.static_range(8):
            acc = warpgroup_mma(xs.slice(16 * r, 16, dim=1), bs.slice(16 * r, 16, dim=1).permute((1, 0)), acc,
                                is_async=True)
        acc = warpgroup_mma_wait(8, deps=[acc])                   # tile i-1's wgmmas are done: free its stages
        if i > 0:
            mbarrier.arrive(xempty.index((i + SX - 1) % SX))
            mbarrier.arrive(bempty.index((i + SB - 1) % SB))
    acc = warpgroup_mma_wait(0, deps=[acc])
    OUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    out = gl.convert_layout(acc * (2.0 ** 119 / gl.load(gs_ptr)), OUT)                 # (64 tokens, BN) fp32
    m = m0 + gl.arange(0, 64, gl.SliceLayout(1, OUT))
    n = n0 + gl.arange(0, BN, gl.SliceLayout(0, OUT))
    mask = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT > 1:
        mp = gl.num_programs(1) * 64
        gl.store(ws_ptr + (gl.program_id(2) * mp + m[:, None]) * N + n[None, :], out, mask=mask)
        gl.thread_barrier()
        tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            out = gl.zeros((64, BN), gl.float32, OUT)
            for sp in range(SPLIT):
                out += gl.load(ws_ptr + (sp * mp + m[:, None]) * N + n[None, :], mask=mask, other=0.0,
                               cache_modifier=".cg")
            gl.store(y_ptr + m[:, None] * stride_ym + n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
    else:
        gl.store(y_ptr + m[:, None] * stride_ym + n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _bars(S: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit
def _dq_kernel(w_desc, s_desc, x_desc, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, NP, NT, stride_ym,
               BN: gl.constexpr, SA: gl.constexpr, SX: gl.constexpr, SB: gl.constexpr, SPLIT: gl.constexpr,
               DW: gl.constexpr, DREG: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr):
    n0, m0 = gl.program_id(0) * BN, gl.program_id(1) * 64
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [SX, 64, 128], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [SB, BN, 128],
                                       gl.NVMMASharedLayout.get_default_for([BN, 128], gl.bfloat16))
    w_bufs = gl.allocate_shared_memory(gl.int32, [SA, BN, 16], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.int32, [SA, BN // 2, 4], s_desc.layout)
    aready, aempty = _bars(SA), _bars(SA)
    xready, xempty = _bars(SX), _bars(SX)
    bready, bempty = _bars(SB), _bars(SB)
    t0 = gl.program_id(2) * NT
    gl.warp_specialize([
        (_mma, (x_bufs, b_bufs, xready, xempty, bready, bempty, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, n0, m0, NT,
                stride_ym, BN, SX, SB, SPLIT)),
        (_wloader, (w_desc, s_desc, w_bufs, s_bufs, aready, aempty, n0, NP, t0, NT, SA)),
        (_xloader, (x_desc, x_bufs, xready, xempty, m0, t0, NT, SX)),
        (_dequant, (w_bufs, s_bufs, b_bufs, aready, aempty, bready, bempty, NT, BN, SA, SB, WL, SL)),
    ], [1, 1, DW], [40, 40, DREG])


def dq_mm(x2: torch.Tensor, w: "kernels.NVFP4Weight", BN=128, SA=6, SX=4, SB=2, split=1, DW=4, DREG=128, maxnreg=None):
    """(M, K) bf16 -> (M, N) = x2 @ W_hat^T, M <= 64 per token tile."""
    if DW != 4:
        raise ValueError("only DW=4 dequantizing warps give correct results (8 did not; not investigated)")
    M, K = x2.shape
    KT, NP = w.words.shape[0], w.words.shape[1]
    assert KT % split == 0
    NT = KT // split
    w_desc = TensorDescriptor.from_tensor(w.words.view(KT * NP, 16), [BN, 16],
                                          gl.NVMMASharedLayout.get_default_for([BN, 16], gl.int32))
    s_desc = TensorDescriptor.from_tensor(w.scales.view(KT * NP // 2, 4), [BN // 2, 4],
                                          gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    x_desc = TensorDescriptor.from_tensor(x2, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16))
    y = torch.empty(M, w.n, dtype=x2.dtype, device=x2.device)
    grid = (-(-w.n // BN), -(-M // 64), split)
    ws, cnt = kernels._workspace(x2.device, split * grid[1] * 64 * w.n if split > 1 else 0, grid[0] * grid[1])
    wl, sl = _layouts(BN, DW)
    _dq_kernel[grid](w_desc, s_desc, x_desc, w.global_scale, y, ws, cnt, M, w.n, NP, NT, y.stride(0), BN=BN, SA=SA, SX=SX,
                     SB=SB, SPLIT=split, DW=DW, DREG=DREG, WL=wl, SL=sl, num_warps=4, maxnreg=maxnreg)
    return y


if __name__ == "__main__":  # correctness against the fp32 reference, then times against bf16 and the dispatch
    import json
    import bench

    torch.manual_seed(0)
    B64 = dict(BN=64, SA=8, SX=4, SB=3)
    CHECK = [dict(BN=128), dict(BN=128, split=2), dict(BN=128, split=4), dict(B64), dict(B64, split=2),
             dict(BN=128, SA=4, SX=2, SB=3)]
    for (N, K) in [(256, 256), (4608, 3584), (3584, 18944)]:
        w = bench.random_nvfp4(N, K, 1)[1][0]
        for M in (1, 48, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = kernels.nvfp4_linear_ref(x, w).float()
            for c in CHECK:
                if w.words.shape[0] % c.get("split", 1) == 0:
                    err = ((dq_mm(x, w, **c).float() - ref).abs().max() / ref.abs().max()).item()
                    print(f"check N={N} K={K} M={M} {c}: max error / max |y| = {err:.1e}", flush=True)
    CFGS = {"qkv": [dict(BN=128, split=2), dict(B64), dict(BN=128, SA=4, SX=2, SB=3, split=2)],
            "o": [dict(BN=128, split=4), dict(B64, split=2)],
            "gate_up": [dict(BN=128), dict(BN=128, SA=4, SX=2, SB=3), dict(B64)],
            "down": [dict(BN=128, split=4), dict(BN=128, SA=4, SX=2, SB=3, split=4), dict(B64, split=2)]}
    for name, (N, K) in bench.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(bench.copies_for(N * K * 2))]
        wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))[1]
        for M in (16, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t = bench.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                [lambda w=w: kernels.nvfp4_linear(x, w) for w in wq],
                                *[[lambda w=w, c=c: dq_mm(x, w, **c) for w in wq] for c in CFGS[name]])
            for label, us in zip(["bf16", "kernels.nvfp4_linear"] + [json.dumps(c) for c in CFGS[name]], t):
                print(f"{name} M={M} {label}: {us:.2f} us, {t[0] / us:.2f}x of bf16", flush=True)
