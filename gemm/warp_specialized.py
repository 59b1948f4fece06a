"""warp_specialized.py: the warp-specialized NVFP4 x bf16 GEMM for Hopper, written in Gluon
(Triton's dialect with explicit layouts, shared memory, mbarriers and warp partitions).
kernels.nvfp4_mm calls it for 33..1023 tokens on an H100 (where ws_config says it wins).

    python -m bench kernels                 # its speed, through kernels.nvfp4_mm's dispatch
    python -m bench kernels --parts ws      # against kernels.py's Triton GEMM,
                                              each token tile and K split
    python -m bench kernels --parts stamps  # where its programs' time goes
                                              (global-timer stamps, docs/KERNELS.md)
    pytest tests/test_kernels.py -k ws      # against the fp32 reference
                                              (GPU only: Gluon has no interpreter)
    pytest tests/test_ws_sass.py            # its machine code:
                                              no in-flight wgmma operand overwritten (CPU too)

Why a second GEMM. kernels._nvfp4_mm_kernel is one warp group that loads, dequantizes and
multiplies; Triton pipelines its loads with asynchronous copies, but every K tile ends in block-wide
barriers and a wait for all its wgmmas. Here the roles are split:
  * a loader warp (40 registers) streams each K tile's weight words, block scales and token tile
    into a ring of S shared-memory stages with TMA, each stage signalling an mbarrier when its bytes
    have landed;
  * one warp group waits on that mbarrier, dequantizes one block of 16 K columns at a time in
    registers (kernels' PTX: the same layout and the same bit tricks) and issues its wgmma at once,
    asynchronously, with the token tile as the shared-memory operand and up to 7 wgmmas in flight;
    it hands a stage back to the loader (an "empty" mbarrier) when the next tile's wgmmas show that
    the stage's have completed.
The weight tile is 64 rows (BN), the token tile BM = 64, 128 or 256. A 256-token program dequantizes
each weight once for twice the tokens: its K loop takes 0.73 us a K tile against 0.45 us at 128
tokens, its wgmmas at about 80% of the tensor cores' peak, so it wins where it needs fewer waves of
programs (qkv at 256 tokens: 72 programs, 21.2 us, against two waves of 128-token ones, 27.3 us).
Its 3 x 68.5 KB ring leaves no room for the 64 KB that converting the accumulator to the store
layout takes, so the tile goes through token stage 0 after the loop, transposed and swizzled
(1.4 us; 3.8 us with the plain row-major layout's 8-way bank conflicts).
A wgmma reads its register operand while in flight, and ptxas protects those registers only up to a
loop back-edge (see _consumer), so the loop body is one lap of the ring (S K tiles, each stage's
mbarriers indexed at compile time) and drains its wgmmas at the end; tests/test_ws_sass.py checks
the SASS.
K may be split (SPLIT programs per output tile, each over KT / SPLIT tiles): they park fp32 partial
sums in kernels.py's workspace and the last to finish (a counter per tile) adds them up, as
kernels.py's GEMM does.
The rollout's LoRA term (lora=(xa, B): y += xa @ B^T, xa = x @ A^T) is added in the epilogue on the
tensor cores: xa's tile goes into a free token stage as the wgmma's shared-memory operand, B's rows
are the register operand, 16 ranks a wgmma (in split 0's partial when K is split). It costs 0.17 ms
of a 7B decode step at batch 64 over the four shapes' 2.64 ms, where the Triton GEMM's epilogue term
cost 0.32 ms (`python -m bench profile --batches 64 --lora-rank 32`, and without --lora-rank).

Leaves out: splits that do not divide the K tiles, a CPU path (the reference is
kernels.nvfp4_linear_ref; the tests compare on the GPU), two consumer warp groups sharing one token
tile (a 128-row tile on 8 warps: with Triton 3.6's setmaxnreg each group gets 232 registers and
keeps 7 wgmmas in flight, yet the best config per case was slower at 64 and 128 tokens on every
shape: qkv at 64 tokens 15.3 vs 12.1 us, gate_up 53.8 vs 44.8, down 30.2 vs 26.6; commit 647f172,
`python bench_ws128.py 64,128`), a 128-row weight tile in one warp group (two wgmmas per block, half
the token traffic per weight: qkv at 64 tokens 20.1 vs 13.2 us, gate_up 74 vs 53 us: the limit is
the warp group's dequantization, not the token tiles' L2 traffic), a deeper ring at 64 tokens while
the epilogue had its own 16 KB conversion buffer (5 or 8 stages: one program an SM instead of two,
gate_up 55.1 / 54.8 vs 46.8 us; qkv, one an SM anyway, 12.1 / 12.3 vs 12.0; with the conversion in a
token stage, two programs an SM now take 5, see ws_config, and 128-token tiles take 5), two
128-token programs an SM (168 registers and 2 stages each: qkv at 256 tokens 44.3 vs 21.4 us for the
256-token tiles; with 3 stages, one an SM again, 30.0 us), a stream-K schedule (P programs share out
every K tile of every output tile, the last of a tile's programs adds the parked partials): slower
where it was meant to help (qkv at 64 tokens over 132 programs 16.5 us, one program per weight tile
14.6 us, with 47 vs 28 MB through L2), 5-10% faster only at 224-384 tokens, and its per-tile
bookkeeping made every other call 8-13% slower, so it was dropped. Tried again with 128- and
256-token tiles (each program at least half a tile's K, its ring carrying on from one tile to the
next), it was 1.15-1.65x slower than the best plain schedule in all 10 cases it applies to (qkv at
256 tokens 29.2 vs 22.1 us, o at 512 tokens 37.8 vs 22.9 us). Nor a K split of only the last,
partial wave's tiles (programs past the whole waves take 1/2-1/4 of a tile's K): no faster in 13 of
14 cases (gate_up at 64 tokens 49.1 vs 48.5 us, at 256 tokens 119.2 vs 114.8 us; down at 768 tokens
188 vs 207 us), as programs start whenever an SM frees up rather than in waves, and a lone program
runs faster than two an SM (0.39 vs 0.55 us a K tile). Two more, timed against the dispatch in one
run each and dropped: 16- and 32-token tiles for 1-32 tokens (slower than the Triton GEMM in all 12
cases but down at 32 tokens, 23.4 vs 23.7 us; gate_up at 1 token 44.1 vs 33.8 us, with 3-4 programs
an SM); more 64-token programs an SM through fewer registers (96-104) and shallower rings (2-3
stages): no faster than 2 programs of 4 stages in any of the 14 cases at 48-128 tokens, tied once
(gate_up at 64 tokens 74.7 us with 2 stages, 55.6 with 3, 45.7 with 4), so the ring's depth matters
more than the programs an SM. And one compiled only: two consumer warp groups of 64 rows each
sharing one token ring (so that two such programs, 288 threads each, fit an SM): ptxas serializes
their wgmmas at every register budget from 96 to 168 (advisory C7512, "insufficient register
resources"), as with the shared token tile above. Nor the weights as the wgmma's B operand,
dequantized into a shared-memory ring by 4 warps of their own for a warp group that only issues
wgmmas (tokens as the A operand): 1.3-2.2x slower at 16 and 64 tokens (gate_up at 64 tokens
78.8 vs 48.8 us), as each weight then crosses shared memory twice in bf16 (docs/KERNELS.md,
"Dequantizing in separate warps"). Nor resident programs looping over the tiles, the tiles left
after whole rounds cut in K (gate_up at 64 tokens 45.5 vs 45.5 us; spills with LoRA; commit 0160692,
`python bench_persist.py`), nor programmatic dependent launch (commit 79466be; both in
docs/KERNELS.md). Nor prefetching each program's words into L2 a few K tiles ahead (slower the
further ahead: gate_up at 64 tokens 43.5 -> 45.3-53.6 us), nor fewer, wider TMA rows (within 1%;
commits 6145b04 and 78e5b69, in docs/KERNELS.md's last section, which also shows that at 64 tokens
the reads through the ring take 76-90% of the time), nor the tokens in a ring of their own beside a
deeper one of words (slower in all 12 shape and token cases: gate_up at 64 tokens 51.6 vs 43.8 us;
commit 36c3655), nor a sixth stage for 128-token tiles (0.97-1.01x; commit 8539a33; both in
docs/KERNELS.md).
"""
import functools

import torch

from gemm.layout import INTERPRET, NVFP4Weight, bits_ptx, lora_args, scale_ptx, workspace

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: kernels.nvfp4_mm keeps to its own kernel
    gluon = None

BN = 64          # weight rows per program: one warp group's wgmma M
# ring depth by token tile: 4 x 20.5 KB (5 where ws_config says), 5 x 36.5, 3 x 68.5
STAGES = {64: 4, 128: 5, 256: 3}
# a 256-token program's time over a 128-token one's, same K: 1.5-1.65
# (python -m bench kernels --parts ws)
T256 = 1.65


@functools.cache
def _on_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


# built once per token tile, not per call: 164 -> 139 us of host time a call (python -m bench one)
@functools.cache
def _smem_layouts(BM: int):
    """Shared-memory layouts of the TMA boxes: words (BN, 16), scales (BN / 2, 4) (16-byte rows),
    tokens (BM, 128)."""
    return (gl.NVMMASharedLayout.get_default_for([BN, 16], gl.int32),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
            gl.NVMMASharedLayout.get_default_for([BM, 128], gl.bfloat16))


def usable(x2: torch.Tensor) -> bool:
    """True where this kernel may run: Gluon present, a Hopper GPU,
    bf16 tokens whose base TMA can address."""
    return (gluon is not None and x2.is_cuda and not INTERPRET and x2.dtype == torch.bfloat16
            and x2.data_ptr() % 16 == 0 and _on_hopper(x2.device.index or 0))


def ws_config(M: int, N: int, K: int, sms: int = 132) -> dict | None:
    """The token tile BM and K split for M tokens, or None where kernels.py's Triton GEMM is as fast
    or faster; from `python -m bench kernels --parts ws` on an H100 (7B shapes, 24..768 tokens;
    docs/KERNELS.md). A 128-token program takes a whole SM (255 registers), a 64-token one half of
    it (128 registers), so the question is how many programs fill the 132 SMs and how many token
    rows are padding:
      * 33..64 tokens (64-token tiles): a short K (< 64 tiles) split in 2 where that still fits one
        program an SM (o at 64 tokens: 1.13x of bf16, the Triton GEMM 1.01x; at 40: 1.13x vs 1.04x),
        else unsplit (qkv 1.27x vs 1.05x at 64, 1.21x vs 1.09x at 40; gate_up, 592 programs,
        2.43x vs 2.30x at 64); a long K (down) split in up to 4 while that makes at most two
        programs an SM (2.09x vs 1.87x at 64). Two programs an SM take a 5-stage ring (gate_up at 64
        tokens 43.5 vs 44.8 us with 4, 46.1 vs 47.8 with LoRA; down 27.1 vs 27.3; one program an SM
        is no faster with 5: qkv 12.1 vs 12.0; commit 0e6c9ae, `python bench_epi.py`). Below 64
        tokens only where the programs fit the SMs: with more, ws_mm pads the tokens to 64 rows,
        which costs 3-4 us (down at 56 tokens 31.1 vs 29.8 us for the Triton GEMM, gate_up
        46.8 vs 47.6). At 24 tokens the Triton GEMM's 32-token tiles win everywhere (qkv
        10.6 vs 13.5 us);
      * 65..256 tokens: 128-token tiles while they fit one wave; with room for twice as many
        programs, a long K (down) splits in 2 (1.47x vs 1.32x at 128 tokens) and a short one (o)
        takes 64-token tiles (0.95x vs 0.81x). Past one wave, 64-token tiles where they leave less
        padding (129..192 tokens: gate_up 0.97x vs 0.89x at 192) and 128-token tiles elsewhere;
      * 193..1023 tokens: 256-token tiles (one program an SM, 3 stages) where their waves of
        programs, each T256 = 1.65 times as long as a 128-token wave, take less time than the
        128-token tiles' waves (o at 512 tokens: one wave, 22.3 us, against two, 27.8 us; qkv at 256
        tokens 21.2 vs 27.3 us); else 128-token tiles, unsplit."""
    KT, NT = -(-K // 128), -(-N // BN)
    # programs with 64- .. 256-token tiles
    p64, p128, p256 = NT * -(-M // 64), NT * -(-M // 128), NT * -(-M // 256)
    c64 = dict(BM=64, maxnreg=128)
    c128 = dict(BM=128, maxnreg=None)
    c256 = dict(BM=256, maxnreg=None)
    # 256-token waves beat 128-token ones
    wide = M > 192 and -(-p256 // sms) * T256 < -(-p128 // sms)
    if M <= 64:
        if KT >= 64:  # long K: split to fill the SMs, at most two programs an SM
            split = next((s for s in (4, 3, 2) if KT % s == 0 and s * p64 <= 2 * sms), None)
        else:
            split = 2 if 2 * p64 <= sms and KT % 2 == 0 else 1
        # the tokens would be padded to 64 rows (ws_mm)
        if split is None or (M < 64 and split * p64 > sms):
            return None
        cfg = dict(c64, SPLIT=split) if split > 1 else dict(c64)
        if split * p64 > sms:  # two programs an SM: 5 stages of 20.5 KB still fit
            cfg["S"] = 5
        return cfg
    if M > 256:
        return c256 if wide else c128
    if 2 * p128 <= sms:  # room for twice the programs
        if KT < 64:
            return c64
        return dict(c128, SPLIT=2) if KT % 2 == 0 else None
    if p128 <= sms:
        return c128
    if wide:
        return c256
    return c64 if -(-M // 64) * 64 < -(-M // 128) * 128 else c128


if gluon is not None:
    _SCALE_ASM = gl.constexpr(scale_ptx(False))  # Hopper's (layout.py)

    @gluon.jit
    def _rows(v, like):
        return gl.broadcast(v[:, None], like)[0]  # (64,) -> (64, 16)

    # the register layouts kernels.py's Triton kernel gets from the compiler, written out: a thread
    # holds rows r, r + 8 and columns c, c + 1, c + 8, c + 9 of a (16, 16) block, which is the wgmma
    # A-operand fragment
    _WL = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0], [0, 8]],
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 16]))
    _SL = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 2]))

    def _block_ptx(r):
        # layout.code_ptx for one block r: the pair of words (columns 2p, 2p + 1: $1 blocks 0-3,
        # $2 blocks 4-7) -> the bf16x2 $0 of block r, times its multiplier $3
        bits = bits_ptx("$1" if r < 4 else "$2", r % 4)
        return "{ .reg .b32 t<2>; " + bits + " mul.rn.bf16x2 $0, t0, $3; }"

    _BLOCK_ASM = gl.constexpr(tuple(_block_ptx(r) for r in range(8)))

    @gluon.jit
    def _block(words, mult, r: gl.constexpr):
        # block r (16 K columns) of the tile: words (64, 16) int32 and its multiplier (64,)
        # -> (64, 16) bf16 q * s
        return gl.inline_asm_elementwise(_BLOCK_ASM[r], "=r,r,r,r,r", [words, _rows(mult, words)],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)

    @gluon.jit
    def _fetch(w_buf, s_buf, ready, phase):
        # wait for a stage's tile; its words (64, 16) and the 8 block-scale multipliers (64,) of
        # each row
        mbarrier.wait(ready, phase)
        words = w_buf.load(_WL)  # (64, 16) int32
        sw = s_buf._reinterpret(gl.int32, [64, 2],
                                gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(_SL)
        sw0, sw1 = gl.split(sw)  # (64,) each
        sw0 = gl.convert_layout(sw0, gl.SliceLayout(1, _WL), assert_trivial=True)
        sw1 = gl.convert_layout(sw1, gl.SliceLayout(1, _WL), assert_trivial=True)
        mult = gl.inline_asm_elementwise(_SCALE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [sw0, sw1],
                                         dtype=(gl.int32,) * 8, is_pure=True, pack=1)
        return words, mult

    @gluon.jit
    def _tile(acc, w_bufs, s_bufs, x_bufs, ready, i, u: gl.constexpr, phase, BM: gl.constexpr):
        # K tile i from ring stage u: 8 async wgmmas, each issued as soon as its block
        # (16 K columns) is dequantized
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        words, mult = _fetch(w_bufs.index(u), s_bufs.index(u), ready[u], phase)
        xt = x_bufs.index(u).permute((1, 0))                  # (128, BM) tokens^T
        for r in gl.static_range(8):                          # k = 16 r + c
            blk = _block(words, mult[r], r)                   # (64, 16) bf16
            q = gl.convert_layout(blk, DOT, assert_trivial=True)
            if r == 0:  # the first wgmma of the program zeroes the accumulator
                acc = warpgroup_mma(q, xt.slice(0, 16), acc, use_acc=i > 0, is_async=True)
            else:
                acc = warpgroup_mma(q, xt.slice(16 * r, 16), acc, is_async=True)
            acc = warpgroup_mma_wait(7, deps=[acc])
        return acc

    @gluon.jit
    def _bar():
        b = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(b, count=1)
        return b

    @gluon.jit
    def _ring(S: gl.constexpr):
        # S mbarriers, each its own allocation (see _consumer)
        bars = (_bar(),)
        for _ in gl.static_range(S - 1):
            bars = bars + (_bar(),)
        return bars

    @gluon.jit
    def _stamp(st_ptr, j: gl.constexpr):
        # the global timer (ns) into st_ptr[program, j]: where a program's time goes
        # (python -m bench kernels --parts stamps)
        z = gl.arange(0, 128, gl.BlockedLayout([1], [32], [4], [0]))
        ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [z], dtype=gl.int64,
                                       is_pure=False, pack=1)
        p = ((gl.program_id(2) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(0)
             + gl.program_id(0))
        gl.store(st_ptr + p * 4 + j + z * 0, ns, mask=z == 0)

    @gluon.jit
    def _consumer(w_bufs, s_bufs, x_bufs, ready, empty, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                  st_ptr, xa_ptr, lb_ptr, M, N, n0, m0, NT, stride_ym, R, BM: gl.constexpr,
                  S: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, RP: gl.constexpr,
                  STAMP: gl.constexpr):
        # One lap of the ring (S K tiles, stage u = 0 .. S - 1 known at compile time) per loop
        # iteration, up to 7 wgmmas in flight. A wgmma reads its A operand (the weights) from
        # registers while in flight. ptxas keeps those registers from being reused until the wait
        # that completes it, but not across a loop back-edge: with wgmmas in flight from one
        # iteration to the next, the next tile's dequantization overwrote their operands (wrong
        # results in 23 of 240 runs; with 3 stages or 168 registers, every run). So every lap ends
        # with all its wgmmas complete; the NT % S tiles after the last lap are straight-line code,
        # drained once at the end.
        # A stage goes back to the loader by an mbarrier arrive (release semantics) once its reads
        # are done (the words and scales loaded to registers, its wgmmas retired by a wait); the
        # loader's wait (acquire) orders its next TMA writes after them, with no proxy fence (one
        # per release cost 1-4%: 2% geomean over 19 dispatched shapes). Each stage's mbarriers are
        # allocations of their own, indexed at compile time: Triton puts a warp-group barrier
        # between two waits on one allocation, which the ring indexed at run time (i % S) paid
        # before every K tile (3-8% slower in all 16 cases timed; docs/KERNELS.md).
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        acc = gl.zeros((64, BM), gl.float32, MMA)
        if STAMP:  # start, first tile landed, loop done, stored
            _stamp(st_ptr, 0)
            mbarrier.wait(ready[0], 0)
            _stamp(st_ptr, 1)
        laps = NT // S
        for lap in range(laps):
            for u in gl.static_range(S):
                acc = _tile(acc, w_bufs, s_bufs, x_bufs, ready, lap * S + u, u, lap & 1, BM)
                if u > 0:  # tile u-1's wgmmas are done (<= 7 in flight): free its stage
                    mbarrier.arrive(empty[u - 1])
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty[S - 1])
        # the last NT % S tiles, in stages 0, 1, ..: nothing left to load
        for u in gl.static_range(S - 1):
            if u < NT - laps * S:
                acc = _tile(acc, w_bufs, s_bufs, x_bufs, ready, laps * S + u, u, laps & 1, BM)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if STAMP:
            _stamp(st_ptr, 2)
        OUT: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])  # 8 rows n per thread
        out = acc * (2.0 ** 119 / gl.load(gs_ptr))                           # (64, BM) fp32
        if RP > 0:  # the LoRA term, once: in the only program's tile or in split 0's partial
            out = _lora(out, x_bufs.index(1), xa_ptr, lb_ptr, M, N, R, n0, m0,
                        gl.program_id(2) == 0, BM, RP)
        if BM != 128:  # no room for a separate conversion buffer (64 KB at 256 tokens; at 64 tokens
            # its 16 KB would keep two 5-stage programs off an SM): token stage 0, whose reads are
            # all done, holds the tile transposed (BM, 64), 8-float groups swizzled by token pair:
            # conflict-free writes from the wgmma layout, 32-byte reads in the layout of the global
            # stores
            buf = x_bufs.index(0)._reinterpret(gl.float32, [BM, 64],
                                               gl.SwizzledSharedLayout(8, 2, 4, [1, 0]))
            buf.store(gl.permute(out, [1, 0]))
            gl.thread_barrier()
            out = gl.permute(buf.load(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])), [1, 0])
            out = gl.convert_layout(out, OUT, assert_trivial=True)
        else:
            out = gl.convert_layout(out, OUT)
        n = n0 + gl.arange(0, 64, gl.SliceLayout(1, OUT))
        m = m0 + gl.arange(0, BM, gl.SliceLayout(0, OUT))
        mask = ((n[:, None] < N) & (m[None, :] < M)
                & (m[None, :] >= gl.program_id(1) * BM))  # this tile's own rows
        if SPLIT > 1:  # park the partial sum; the last of the SPLIT programs of this output tile
            # adds them up
            mp = gl.num_programs(1) * BM  # padded token count
            gl.store(ws_ptr + (gl.program_id(2) * mp + m[None, :]) * N + n[:, None], out, mask=mask)
            gl.thread_barrier()  # every thread's partial is out before the count
            tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
            if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
                out = gl.zeros((64, BM), gl.float32, OUT)
                for s in range(SPLIT):
                    out += gl.load(ws_ptr + (s * mp + m[None, :]) * N + n[:, None], mask=mask,
                                   other=0.0, cache_modifier=".cg")
                _store(out, n, m, N, b_ptr, y_ptr, stride_ym, mask, HAS_BIAS)
                # no fence: the next launch sees it
                gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
        else:
            _store(out, n, m, N, b_ptr, y_ptr, stride_ym, mask, HAS_BIAS)
        if STAMP:
            _stamp(st_ptr, 3)

    @gluon.jit
    def _lora(out, buf, xa_ptr, lb_ptr, M, N, R, n0, m0, on, BM: gl.constexpr, RP: gl.constexpr):
        # out (64, BM) fp32 += B[n0 : n0 + 64, :R] @ xa[m0 : m0 + BM, :R]^T on the tensor cores (the
        # rollout's LoRA: xa = x @ A^T (M, R), B (N, R); zero where not on). xa goes into a token
        # stage (all its reads are done) in pieces of rows, as the wgmma's shared-memory operand;
        # B's columns are the register operand, 16 at a time.
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        CH: gl.constexpr = 32 if BM == 256 else 64  # rows a piece (fewer beside the 256-token tile)
        r = gl.arange(0, 128, gl.SliceLayout(0, XL))
        for c in gl.static_range(BM // CH):
            m = m0 + CH * c + gl.arange(0, CH, gl.SliceLayout(1, XL))
            xa = gl.load(xa_ptr + m[:, None] * R + r[None, :],
                         mask=(m[:, None] < M) & (r[None, :] < R), other=0.0)
            buf.slice(CH * c, CH).store(xa)  # (CH, 128) bf16
        fence_async_shared()  # the stores, before the async proxy (the wgmma) reads them
        gl.thread_barrier()
        xt = buf.permute((1, 0))  # (128, BM) xa^T
        for j in gl.static_range(RP // 16):
            nn = n0 + gl.arange(0, 64, gl.SliceLayout(1, DOT))
            rr = 16 * j + gl.arange(0, 16, gl.SliceLayout(0, DOT))
            b = gl.load(lb_ptr + nn[:, None] * R + rr[None, :],  # (64, 16) bf16
                        mask=(nn[:, None] < N) & (rr[None, :] < R) & on, other=0.0)
            out = warpgroup_mma(b, xt.slice(16 * j, 16), out, is_async=True)
        return warpgroup_mma_wait(0, deps=[out])

    @gluon.jit
    def _store(out, n, m, N, b_ptr, y_ptr, stride_ym, mask, HAS_BIAS: gl.constexpr):
        # y[m, n] = out (64, BM) fp32 (+ bias[n]), rounded once
        if HAS_BIAS:
            out += gl.load(b_ptr + n, mask=n < N, other=0.0).to(gl.float32)[:, None]
        gl.store(y_ptr + m[None, :] * stride_ym + n[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=mask)

    @gluon.jit
    def _loader(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP, t0, NT,
                S: gl.constexpr):
        # K tiles t0 .. t0 + NT - 1, the j-th into stage j % S
        # (as _consumer: whole laps, then the rest)
        laps = NT // S
        for lap in range(laps):
            for u in gl.static_range(S):
                _load(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP,
                      t0 + lap * S + u, u, (lap & 1) ^ 1)
        for u in gl.static_range(S - 1):
            if u < NT - laps * S:
                _load(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP,
                      t0 + laps * S + u, u, (laps & 1) ^ 1)

    @gluon.jit
    def _load(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP, t,
              u: gl.constexpr, phase):
        # K tile t into stage u once the consumer has freed it
        # (phase: passes at once on the first lap)
        nbytes: gl.constexpr = (w_desc.block_type.nbytes + s_desc.block_type.nbytes
                                + x_desc.block_type.nbytes)
        mbarrier.wait(empty[u], phase)
        mbarrier.expect(ready[u], nbytes)
        tma.async_copy_global_to_shared(w_desc, [t * NP + n0, 0], ready[u], w_bufs.index(u))
        tma.async_copy_global_to_shared(s_desc, [(t * NP + n0) // 2, 0], ready[u], s_bufs.index(u))
        # K OOB: zeros
        tma.async_copy_global_to_shared(x_desc, [m0, t * 128], ready[u], x_bufs.index(u))

    @gluon.jit
    def _ws_kernel(w_desc, s_desc, x_desc, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, st_ptr, xa_ptr,
                   lb_ptr, M, MX, N, NP, NT, stride_ym, R, BM: gl.constexpr, S: gl.constexpr,
                   SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, RP: gl.constexpr = 0,
                   STAMP: gl.constexpr = False):
        # program (n tile, m tile, K split): 64 weight rows, BM tokens,
        # K tiles NT * split .. NT * split + NT - 1.
        # With MX >= BM rows of x, the last token tile is moved back to end at the last row: a TMA
        # box reaching past the rows costs more than recomputing some (gate_up at 160 tokens: 224 us
        # with a half-empty second tile, 130 us moved back); _consumer stores only the tile's own
        # rows.
        n0, m0 = gl.program_id(0) * 64, gl.maximum(gl.minimum(gl.program_id(1) * BM, MX - BM), 0)
        # first: 1 KB aligned
        x_bufs = gl.allocate_shared_memory(gl.bfloat16, [S, BM, 128], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.int32, [S, 64, 16], w_desc.layout)
        # (64, 2) as (32, 4)
        s_bufs = gl.allocate_shared_memory(gl.int32, [S, 32, 4], s_desc.layout)
        ready, empty = _ring(S), _ring(S)  # (S,) mbarriers each
        gl.warp_specialize([
            (_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, gs_ptr, b_ptr, y_ptr, ws_ptr,
                         cnt_ptr, st_ptr, xa_ptr, lb_ptr, M, N, n0, m0, NT, stride_ym, R, BM, S,
                         SPLIT, HAS_BIAS, RP, STAMP)),
            (_loader, (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, n0, m0, NP,
                       gl.program_id(2) * NT, NT, S)),
        ], [1], [40])


def ws_mm(x2: torch.Tensor, w: NVFP4Weight, bias=None, config: dict | None = None,
          stamps: torch.Tensor | None = None, lora=None) -> torch.Tensor:
    """(M, K) bf16 -> (M, N): y = x2 @ W_hat^T (+ bias) with the warp-specialized kernel
    (check usable() first).
    config: dict(BM=64, 128 or 256, maxnreg=registers a thread or None, SPLIT=K splits dividing the
    K tiles (default 1), S=ring stages, 2 to 5 (default STAGES[BM])), default ws_config's
    (or BM = 128). stamps: an int64 tensor of 4 x programs that receives each program's global timer
    (ns) at its start, first tile landed, loop done and output stored (a separate build; the bits of
    y are the same). lora=(xa, B): also add xa @ B^T in the epilogue, as kernels.nvfp4_mm does
    (xa (M, R), contiguous B (N, R), R <= 128)."""
    (M, K), (xa, lb, R) = x2.shape, lora_args(x2, w, lora)
    KT, NP = w.words.shape[0], w.words.shape[1]
    cfg = config or ws_config(M, w.n, K) or dict(BM=128, maxnreg=None)
    BM, split = cfg["BM"], cfg.get("SPLIT", 1)
    if BM not in (64, 128, 256):
        raise ValueError(f"BM (tokens per program) must be 64, 128 or 256, got {BM}")
    if KT % split:
        raise ValueError(f"SPLIT={split} must divide the {KT} K tiles of 128")
    S = cfg.get("S", STAGES[BM])
    if not 2 <= S <= 5:
        raise ValueError(f"S (ring stages) must be 2 to 5, got {S}")
    NT = KT // split  # K tiles per program
    # TMA descriptors: words (KT * NP, 16), scales (KT * NP / 2, 4) (16-byte rows), tokens (M, K),
    # 128-byte swizzle
    wl, sl, xl = _smem_layouts(BM)
    w_desc = TensorDescriptor.from_tensor(w.words.view(KT * NP, 16), [BN, 16], wl)
    s_desc = TensorDescriptor.from_tensor(w.scales.view(KT * NP // 2, 4), [BN // 2, 4], sl)
    if M < BM and -(-w.n // BN) * split > 132:
        # fewer tokens than a tile and more programs than SMs: pad the tokens (see _ws_kernel;
        # gate_up at 96 tokens: 96 -> 75 us); with few programs a box past the rows costs nothing
        # measurable and padding 3 us
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, BM - M))
    x_desc = TensorDescriptor.from_tensor(x2, [BM, 128], xl)
    y = torch.empty(M, w.n, dtype=x2.dtype, device=x2.device)
    grid = (-(-w.n // BN), -(-M // BM), split)
    floats = split * grid[1] * BM * w.n if split > 1 else 0
    ws, cnt = workspace(x2.device, floats, grid[0] * grid[1])
    if stamps is not None and stamps.numel() < 4 * grid[0] * grid[1] * split:
        raise ValueError(f"stamps needs 4 x {grid[0] * grid[1] * split} int64 entries, "
                         f"got {stamps.numel()}")
    _ws_kernel[grid](
        w_desc, s_desc, x_desc, w.global_scale, bias if bias is not None else y, y, ws, cnt,
        stamps if stamps is not None else cnt, xa, lb, M, x2.shape[0], w.n, NP, NT, y.stride(0), R,
        BM=BM, S=S, SPLIT=split, HAS_BIAS=bias is not None, RP=-(-R // 16) * 16,
        STAMP=stamps is not None, num_warps=4, maxnreg=cfg["maxnreg"])
    return y
