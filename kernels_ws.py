"""kernels_ws.py: the warp-specialized NVFP4 x bf16 GEMM for Hopper, written in Gluon (Triton's dialect with explicit
layouts, shared memory, mbarriers and warp partitions). kernels.nvfp4_mm calls it for 49..1023 tokens on an H100
(where ws_config says it wins).

    python bench.py kernels                 # its speed, through kernels.nvfp4_mm's dispatch
    python bench.py kernels --parts ws      # against kernels.py's Triton GEMM, each token tile and register budget
    pytest tests/test_kernels.py -k ws      # against the fp32 reference (GPU only: Gluon has no interpreter)
    pytest tests/test_ws_sass.py            # its machine code: no in-flight wgmma operand overwritten (CPU too)

Why a second GEMM. kernels._nvfp4_mm_kernel is one warp group that loads, dequantizes and multiplies; Triton pipelines
its loads with asynchronous copies, but every K tile ends in block-wide barriers and a wait for all its wgmmas.
Here the roles are split:
  * a loader warp (40 registers) streams each K tile's weight words, block scales and token tile into a ring of
    S shared-memory stages with TMA, each stage signalling an mbarrier when its bytes have landed;
  * one warp group waits on that mbarrier, dequantizes one block of 16 K columns at a time in registers (kernels'
    PTX: the same layout and the same bit tricks) and issues its wgmma at once, asynchronously, with the token tile
    as the shared-memory operand and up to 7 wgmmas in flight; it hands a stage back to the loader (an "empty"
    mbarrier) when the next tile's wgmmas show that the stage's have completed.
The weight tile is 64 rows (BN), the token tile BM = 64 or 128. A wgmma reads its register operand while in flight,
and ptxas protects those registers only up to a loop back-edge (see _consumer), so the loop body is U = 4 (or 2, 1:
a divisor of the K tiles) tiles long and drains its wgmmas at the end; tests/test_ws_sass.py checks the SASS.
K is not split: where the tiles are too few to fill the GPU, kernels.py's split-K kernel runs.

Leaves out: split-K, the LoRA epilogue term (calls with lora= take the Triton GEMM), a CPU path (the reference is
kernels.nvfp4_linear_ref; the tests compare on the GPU), two consumer warp groups sharing one token tile (with 12
warps a thread gets at most 168 registers and ptxas serializes the wgmmas: measured 0.69x of one group on qkv at 64
tokens).
"""
import functools

import torch
import triton

import kernels

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: kernels.nvfp4_mm keeps to its own kernel
    gluon = None

BN = 64          # weight rows per program: one warp group's wgmma M
STAGES = 4       # shared-memory ring depth (4 x 36.5 KB at 128 tokens)
UNROLL = 4       # K tiles per consumer loop iteration, at most (ws_mm takes the largest of 4, 2, 1 dividing them)


@functools.cache
def _on_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def usable(x2: torch.Tensor) -> bool:
    """True where this kernel may run: Gluon present, a Hopper GPU, bf16 tokens whose base TMA can address."""
    return (gluon is not None and x2.is_cuda and not kernels.INTERPRET and x2.dtype == torch.bfloat16
            and x2.data_ptr() % 16 == 0 and _on_hopper(x2.device.index or 0))


def ws_config(M: int, N: int, K: int) -> dict | None:
    """The token tile for M tokens, or None where kernels.py's split-K Triton GEMM is faster (`python bench.py kernels
    --parts ws`). Above 128 tokens: 128-token tiles (255 registers a thread, one program per SM). Up to 128 this
    kernel, which does not split K, needs >= 64 tiles to fill the GPU and a short K: 64 or 128 tokens, whichever gives
    >= 64 tiles, 64-token tiles with 128 registers (two programs per SM). On the 7B shapes at 64 tokens that leaves o
    (56 tiles) and down (148 K tiles) to kernels.py, at 128 down."""
    if M > 128:
        return dict(BM=128, maxnreg=None)
    if -(-K // 128) >= 64:
        return None
    for BM in ((64,) if M <= 64 else (128, 64)):
        if -(-N // BN) * -(-M // BM) >= 64:
            return dict(BM=BM, maxnreg=128 if BM == 64 else None)
    return None


if gluon is not None:
    _SCALE_ASM = gl.constexpr(kernels._SCALE_ASM.value)

    @gluon.jit
    def _rows(v, like):
        return gl.broadcast(v[:, None], like)[0]                                             # (64,) -> (64, 16)

    # the register layouts kernels.py's Triton kernel gets from the compiler, written out: a thread holds rows r, r + 8
    # and columns c, c + 1, c + 8, c + 9 of a (16, 16) block, which is the wgmma A-operand fragment
    _WL = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0], [0, 8]],
                                                  lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                                  warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16]))
    _SL = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]],
                                                  lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                                  warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 2]))

    def _block_ptx(r):
        # kernels._code_ptx for one block r: the pair of words (columns 2p, 2p + 1: $1 blocks 0-3, $2 blocks 4-7)
        # -> the bf16x2 $0 of block r, times its multiplier $3
        a, b = kernels.ROT[r % 4]
        w = "$1" if r < 4 else "$2"
        mag = f"shf.r.wrap.b32 t0, {w}, {w}, {a};" if a else f"mov.b32 t0, {w};"
        if a == b:
            bits = " and.b32 t0, t0, 0x81C081C0;"
        else:
            bits = (f" shf.r.wrap.b32 t1, {w}, {w}, {b}; and.b32 t1, t1, 0x80008000;"
                    f" lop3.b32 t0, t0, 0x01C001C0, t1, 0xEA;")
        return "{ .reg .b32 t<2>; " + mag + bits + " mul.rn.bf16x2 $0, t0, $3; }"

    _BLOCK_ASM = gl.constexpr(tuple(_block_ptx(r) for r in range(8)))

    @gluon.jit
    def _block(words, mult, r: gl.constexpr):
        # block r (16 K columns) of the tile: words (64, 16) int32 and its multiplier (64,) -> (64, 16) bf16 q * s
        return gl.inline_asm_elementwise(_BLOCK_ASM[r], "=r,r,r,r,r", [words, _rows(mult, words)], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _fetch(w_bufs, s_bufs, ready, i, S: gl.constexpr):
        # wait for tile i's stage; its words (64, 16) and the 8 block-scale multipliers (64,) of each row
        s = i % S
        mbarrier.wait(ready.index(s), (i // S) & 1)
        words = w_bufs.index(s).load(_WL)                                                    # (64, 16) int32
        sw = s_bufs.index(s)._reinterpret(gl.int32, [64, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(_SL)
        sw0, sw1 = gl.split(sw)                                                              # (64,) each
        sw0 = gl.convert_layout(sw0, gl.SliceLayout(1, _WL), assert_trivial=True)
        sw1 = gl.convert_layout(sw1, gl.SliceLayout(1, _WL), assert_trivial=True)
        mult = gl.inline_asm_elementwise(_SCALE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [sw0, sw1], dtype=(gl.int32,) * 8,
                                         is_pure=True, pack=1)
        return words, mult

    @gluon.jit
    def _consumer(w_bufs, s_bufs, x_bufs, ready, empty, gs_ptr, b_ptr, y_ptr, M, N, n0, m0, NT, stride_ym,
                  BM: gl.constexpr, S: gl.constexpr, U: gl.constexpr, HAS_BIAS: gl.constexpr):
        # U K tiles per loop iteration, 8 async wgmmas each, each issued as soon as its block (16 K columns) is
        # dequantized, with up to 7 in flight. A wgmma reads its A operand (the weights) from registers while in
        # flight. ptxas keeps those registers from being reused until the wait that completes it, but not across a
        # loop back-edge: with wgmmas in flight from one iteration to the next, the next tile's dequantization
        # overwrote their operands (wrong results in 23 of 240 runs; with 3 stages or 168 registers, every run). So
        # every iteration ends with all its wgmmas complete, and U tiles per iteration pay for that drain.
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        acc = gl.zeros((64, BM), gl.float32, MMA)
        for i0 in range(0, NT, U):                                  # U divides NT (ws_mm)
            for u in gl.static_range(U):
                i = i0 + u
                words, mult = _fetch(w_bufs, s_bufs, ready, i, S)
                xt = x_bufs.index(i % S).permute((1, 0))                                     # (128, BM) tokens^T
                for r in gl.static_range(8):                                                 # k = 16 r + c
                    q = gl.convert_layout(_block(words, mult[r], r), DOT, assert_trivial=True)  # (64, 16) bf16
                    if r == 0:  # the first wgmma of the program zeroes the accumulator
                        acc = warpgroup_mma(q, xt.slice(0, 16), acc, use_acc=i > 0, is_async=True)
                    else:
                        acc = warpgroup_mma(q, xt.slice(16 * r, 16), acc, is_async=True)
                    acc = warpgroup_mma_wait(7, deps=[acc])
                if u > 0:
                    fence_async_shared()               # tile i-1's wgmmas are done (<= 7 in flight): free its stage
                    mbarrier.arrive(empty.index((i + S - 1) % S))
            acc = warpgroup_mma_wait(0, deps=[acc])
            fence_async_shared()
            mbarrier.arrive(empty.index((i0 + U - 1) % S))
        OUT: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])                # 8 rows n per thread
        out = gl.convert_layout(acc * (2.0 ** 119 / gl.load(gs_ptr)), OUT)                   # (64, BM) fp32
        n = n0 + gl.arange(0, 64, gl.SliceLayout(1, OUT))
        m = m0 + gl.arange(0, BM, gl.SliceLayout(0, OUT))
        if HAS_BIAS:
            out += gl.load(b_ptr + n, mask=n < N, other=0.0).to(gl.float32)[:, None]
        gl.store(y_ptr + m[None, :] * stride_ym + n[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=(n[:, None] < N) & (m[None, :] < M))

    @gluon.jit
    def _loader(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP, NT, S: gl.constexpr):
        nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes
        for t in range(NT):
            s = t % S
            mbarrier.wait(empty.index(s), ((t // S) & 1) ^ 1)       # passes at once on the first round of the ring
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(w_desc, [t * NP + n0, 0], ready.index(s), w_bufs.index(s))
            tma.async_copy_global_to_shared(s_desc, [(t * NP + n0) // 2, 0], ready.index(s), s_bufs.index(s))
            tma.async_copy_global_to_shared(x_desc, [m0, t * 128], ready.index(s), x_bufs.index(s))  # OOB: zeros

    @gluon.jit
    def _ws_kernel(w_desc, s_desc, x_desc, gs_ptr, b_ptr, y_ptr, M, N, NP, KT, stride_ym,
                   BM: gl.constexpr, S: gl.constexpr, U: gl.constexpr, HAS_BIAS: gl.constexpr):
        n0, m0 = gl.program_id(0) * 64, gl.program_id(1) * BM
        x_bufs = gl.allocate_shared_memory(gl.bfloat16, [S, BM, 128], x_desc.layout)        # first: 1 KB aligned
        w_bufs = gl.allocate_shared_memory(gl.int32, [S, 64, 16], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.int32, [S, 32, 4], s_desc.layout)              # (64, 2) as (32, 4)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, gs_ptr, b_ptr, y_ptr, M, N, n0, m0, KT, stride_ym, BM,
                         S, U, HAS_BIAS)),
            (_loader, (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP, KT, S)),
        ], [1], [40])


def ws_mm(x2: torch.Tensor, w: "kernels.NVFP4Weight", bias=None, config: dict | None = None) -> torch.Tensor:
    """(M, K) bf16 -> (M, N): y = x2 @ W_hat^T (+ bias) with the warp-specialized kernel (check usable() first).
    config: dict(BM=64 or 128, maxnreg=registers a thread or None), default ws_config's (or BM = 128)."""
    M, K = x2.shape
    KT, NP = w.words.shape[0], w.words.shape[1]
    cfg = config or ws_config(M, w.n, K) or dict(BM=128, maxnreg=None)
    BM = cfg["BM"]
    # TMA descriptors: words (KT * NP, 16), scales (KT * NP / 2, 4) (16-byte rows), tokens (M, K), 128-byte swizzle
    w_desc = TensorDescriptor.from_tensor(w.words.view(KT * NP, 16), [BN, 16],
                                          gl.NVMMASharedLayout.get_default_for([BN, 16], gl.int32))
    s_desc = TensorDescriptor.from_tensor(w.scales.view(KT * NP // 2, 4), [BN // 2, 4],
                                          gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    x_desc = TensorDescriptor.from_tensor(x2, [BM, 128], gl.NVMMASharedLayout.get_default_for([BM, 128], gl.bfloat16))
    y = torch.empty(M, w.n, dtype=x2.dtype, device=x2.device)
    U = next(u for u in (4, 2, 1) if u <= UNROLL and KT % u == 0)                        # K tiles per iteration
    _ws_kernel[(-(-w.n // BN), -(-M // BM))](w_desc, s_desc, x_desc, w.global_scale, bias if bias is not None else y,
                                            y, M, w.n, NP, KT, y.stride(0), BM=BM, S=STAGES, U=U,
                                            HAS_BIAS=bias is not None, num_warps=4, maxnreg=cfg["maxnreg"])
    return y
