"""bench_ring.py: an A/B of kernels_ws's ring of mbarriers, on the H100 (one run; KERNELS.md cites it).

    python bench_ring.py

kernels_ws indexes its ring at run time (stage i % S of one [S, 1] mbarrier allocation), and Triton's barrier
analysis puts a warp-group barrier (bar.sync) between two waits on one allocation: one per K tile. The variant here
gives each stage's mbarriers an allocation of their own and unrolls the consumer and loader loops by one lap of the
ring (S = 4 K tiles), so every index is known at compile time and consecutive waits touch different allocations.
A second variant ("pair") also frees two stages per arrive (one fewer barrier per two tiles, a shallower effective
ring). Times the 7B shapes at 64-256 tokens against kernels_ws.ws_mm with the same tile, in one CUDA-graph run, and
checks the bits are the same. Needs K tiles divisible by 4 (the 7B shapes); no split K, no bias, no stamps."""
import torch

import bench
import kernels
import kernels_ws
import kernels_ws as W
from kernels_ws import gluon, gl, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait, TensorDescriptor
from kernels_ws import _block, _store, _WL, _SL, _SCALE_ASM


@gluon.jit
def _fetch_s(w_buf, s_buf, rdy, phase):
    mbarrier.wait(rdy, phase)
    words = w_buf.load(_WL)
    sw = s_buf._reinterpret(gl.int32, [64, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(_SL)
    sw0, sw1 = gl.split(sw)
    sw0 = gl.convert_layout(sw0, gl.SliceLayout(1, _WL), assert_trivial=True)
    sw1 = gl.convert_layout(sw1, gl.SliceLayout(1, _WL), assert_trivial=True)
    mult = gl.inline_asm_elementwise(_SCALE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [sw0, sw1], dtype=(gl.int32,) * 8,
                                     is_pure=True, pack=1)
    return words, mult


@gluon.jit
def _consumer(w_bufs, s_bufs, x_bufs, ready, empty, gs_ptr, b_ptr, y_ptr, M, N, n0, m0, NT, stride_ym,
              BM: gl.constexpr, S: gl.constexpr, HAS_BIAS: gl.constexpr, PAIR: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    acc = gl.zeros((64, BM), gl.float32, MMA)
    for i0 in range(0, NT, S):
        phase = (i0 // S) & 1
        for u in gl.static_range(S):
            words, mult = _fetch_s(w_bufs.index(u), s_bufs.index(u), ready[u], phase)
            xt = x_bufs.index(u).permute((1, 0))
            for r in gl.static_range(8):
                q = gl.convert_layout(_block(words, mult[r], r), DOT, assert_trivial=True)
                if r == 0:
                    acc = warpgroup_mma(q, xt.slice(0, 16), acc, use_acc=(i0 + u) > 0, is_async=True)
                else:
                    acc = warpgroup_mma(q, xt.slice(16 * r, 16), acc, is_async=True)
                acc = warpgroup_mma_wait(7, deps=[acc])
            if PAIR:
                if u == 2:
                    mbarrier.arrive(empty[0])
            else:
                if u > 0:
                    mbarrier.arrive(empty[u - 1])
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty[len(empty) - 1])
    OUT: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    out = gl.convert_layout(acc * (2.0 ** 119 / gl.load(gs_ptr)), OUT)
    n = n0 + gl.arange(0, 64, gl.SliceLayout(1, OUT))
    m = m0 + gl.arange(0, BM, gl.SliceLayout(0, OUT))
    mask = (n[:, None] < N) & (m[None, :] < M) & (m[None, :] >= gl.program_id(1) * BM)
    _store(out, n, m, N, b_ptr, y_ptr, stride_ym, mask, HAS_BIAS)


@gluon.jit
def _loader(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP, NT, S: gl.constexpr,
            PAIR: gl.constexpr):
    nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes
    for j0 in range(0, NT, S):
        phase = ((j0 // S) & 1) ^ 1
        for u in gl.static_range(S):
            t = j0 + u
            if PAIR:
                if u % 2 == 0:
                    mbarrier.wait(empty[u // 2], phase)
            else:
                mbarrier.wait(empty[u], phase)
            mbarrier.expect(ready[u], nbytes)
            tma.async_copy_global_to_shared(w_desc, [t * NP + n0, 0], ready[u], w_bufs.index(u))
            tma.async_copy_global_to_shared(s_desc, [(t * NP + n0) // 2, 0], ready[u], s_bufs.index(u))
            tma.async_copy_global_to_shared(x_desc, [m0, t * 128], ready[u], x_bufs.index(u))


@gluon.jit
def _bar():
    b = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(b, count=1)
    return b


@gluon.jit
def _wsst_kernel(w_desc, s_desc, x_desc, gs_ptr, b_ptr, y_ptr, M, MX, N, NP, NT, stride_ym,
                 BM: gl.constexpr, HAS_BIAS: gl.constexpr, PAIR: gl.constexpr):
    S: gl.constexpr = 4
    n0, m0 = gl.program_id(0) * 64, gl.maximum(gl.minimum(gl.program_id(1) * BM, MX - BM), 0)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [S, BM, 128], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int32, [S, 64, 16], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.int32, [S, 32, 4], s_desc.layout)
    ready = (_bar(), _bar(), _bar(), _bar())
    if PAIR:
        empty = (_bar(), _bar())
    else:
        empty = (_bar(), _bar(), _bar(), _bar())
    gl.warp_specialize([
        (_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, gs_ptr, b_ptr, y_ptr, M, N, n0, m0, NT, stride_ym, BM, S,
                     HAS_BIAS, PAIR)),
        (_loader, (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP, NT, S, PAIR)),
    ], [1], [40])


def wsst_mm(x2, w, BM=64, maxnreg=128, pair=False):
    M, K = x2.shape
    KT, NP = w.words.shape[0], w.words.shape[1]
    assert KT % 4 == 0
    wl, sl, xl = W._smem_layouts(BM)
    w_desc = TensorDescriptor.from_tensor(w.words.view(KT * NP, 16), [64, 16], wl)
    s_desc = TensorDescriptor.from_tensor(w.scales.view(KT * NP // 2, 4), [32, 4], sl)
    if M < BM and -(-w.n // 64) > 132:
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, BM - M))
    x_desc = TensorDescriptor.from_tensor(x2, [BM, 128], xl)
    y = torch.empty(M, w.n, dtype=x2.dtype, device=x2.device)
    grid = (-(-w.n // 64), -(-M // BM), 1)
    _wsst_kernel[grid](w_desc, s_desc, x_desc, w.global_scale, y, y, M, x2.shape[0], w.n, NP, KT, y.stride(0),
                       BM=BM, HAS_BIAS=False, PAIR=pair, num_warps=4, maxnreg=maxnreg)
    return y


def main():
    for name, (N, K) in bench.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(bench.copies_for(N * K * 2))]
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        for M, BM, mx in [(64, 64, 128), (128, 128, None), (128, 64, 128), (256, 128, None)]:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            base = dict(BM=BM, maxnreg=mx)
            ref = kernels_ws.ws_mm(x, wq[0], config=base)
            got = wsst_mm(x, wq[0], BM, mx)
            same = torch.equal(ref, got)
            t = bench.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                [lambda w=w: kernels.nvfp4_mm(x, w) for w in wq],
                                [lambda w=w: kernels_ws.ws_mm(x, w, config=base) for w in wq],
                                [lambda w=w: wsst_mm(x, w, BM, mx) for w in wq],
                                [lambda w=w: wsst_mm(x, w, BM, mx, True) for w in wq])
            same2 = torch.equal(ref, wsst_mm(x, wq[0], BM, mx, True))
            print(f"{name:7s} M={M:4d} BM={BM} same bits {same}, {same2} | bf16 {t[0]:6.1f} dispatch {t[1]:6.1f} us | "
                  f"ws_mm {t[2]:6.1f} | static stages {t[3]:6.1f} ({t[2] / t[3]:.3f}x) | pair {t[4]:6.1f} "
                  f"({t[2] / t[4]:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
