"""fused_a.py: the NVFP4 GEMMs of a decode step (kernels.py's K-sliced one, 1-8 tokens, and its
split-K one, 9-64) with the LoRA's A product in the same launch, beside their reference (the A
product, then the GEMM).

    pytest tests/test_kernels.py -k fused_a                          # against the reference
    python -m bench rollout --lora-paths --lora-rank 32 --no-hf      # the "fused" path, on a GPU

Why. With an adapter on every linear, a decode step makes four A products a layer, xa = x @ A^T
(M, R), before the GEMMs whose epilogues add xa @ B^T. Each is a launch of its own (cuBLAS, or
layers/shrink.lora_shrink) of a few microseconds where reading A takes under one: at batch 1 the
112 of a 7B step cost about 0.5 ms of a 2.55 ms step (docs/BENCHMARKS.md). Here the GEMM's launch
has PA programs more, which make xa (K split over them, fixed up in program order as
lora_shrink does) while the others stream the weights; a GEMM program waits for xa only before
its epilogue, when the weights it read have taken far longer than A.

Who does what. A program draws a ticket from a counter as it starts: tickets 0..PA-1 make xa, a
ticket t >= PA takes the GEMM's program t - PA (row tile, token tile, K split, in the order of
kernels.py's grid). A program that waits holds a ticket >= PA, so every xa program has already
started, and those never wait: the wait ends in whatever order the GPU starts the programs (a
program id promises no order; a ticket is drawn by a running program). The last output tile to
be finished puts the ticket, the ready flag and its own count back to 0 for the next launch or
CUDA-graph replay.

Measured (7B, rank 32, one H100; experiments/results/rollout-lora-h100/lora-paths-r2-*.log and
profile-lora32-fused.log): slower than the GEMM plus the shrink's own launch, the adapter's cost
29.8% against 23.4% at batch 1, 20.6% against 19.2% at 16; at batch 1 the step's 112 fused launches
took 2.79 ms of kernels where the GEMMs and the shrinks took 2.41. That version read A 128 columns a
step and was given 128 registers a thread where the GEMM alone takes 64 (A_BK below says why that
matters); it now reads 16 and at one token takes no more than the GEMM (tests/test_portable.py;
at 8 tokens still 95-126 registers against the GEMM's 70-96), not yet measured. Off unless
NANOQERL_LORA_FUSED=1 (layers/shrink.FUSED).

Leaves out: what runs on the warp-specialized GEMM (Hopper, 33 tokens and more where it wins:
there the A product keeps its own launch), more than 64 tokens, autograd (generation only).
"""
import torch

import kernels
from gemm.configs import mm_config, split_k
from gemm.layout import NVFP4Weight, workspace
from kernels import _use_triton, triton

if triton is not None:
    import triton.language as tl

    from gemm.epilogue import _fixup, _rows, _store
    from kernels import _ks_acc, _sk_acc
    from layers.shrink import _shrink_part

# an xa program reads A_STEPS blocks of A_BK columns: 256 columns, so 7B's q/k/v (3584) gets 14
# programs, down (18944) 74. The blocks are narrow because the launch is allocated the registers of
# its hungriest branch: with 128 columns a step the xa branch took 128 registers a thread where
# the K-sliced GEMM alone takes 64-80 (sm_90, tests/test_portable.py), which halves the programs
# an SM holds, likely why the batch-1 GEMMs ran slower; with 16 it takes no more than the GEMM
A_BK = 16
A_STEPS = 16
# the most tokens the fused launch takes (xa programs hold every token's row of xa)
MAX_M = 64
# device -> int32 [ticket, xa ready, GEMM programs done]; each launch leaves it at 0
_SYNC: dict = {}


def _sync(device) -> torch.Tensor:
    if device not in _SYNC:
        _SYNC[device] = torch.zeros(3, dtype=torch.int32, device=device)
    return _SYNC[device]


def nvfp4_mm_fused_a_ref(x2: torch.Tensor, w: NVFP4Weight, A: torch.Tensor, B: torch.Tensor,
                         bias=None, gated: int = 0) -> torch.Tensor:
    """The two launches this one replaces: xa = x @ A^T (fp32 sums, one bf16 rounding), then
    kernels.nvfp4_mm with xa @ B^T in its epilogue."""
    import kernels
    from layers.shrink import lora_shrink_ref

    return kernels.nvfp4_mm(x2, w, bias, lora=(lora_shrink_ref(x2, A), B), gated=gated)


if triton is not None:
    @triton.jit
    def _tile_done(sync_ptr, NT):
        # an output tile is stored: the last of the NT puts the ticket, flag and count back
        if tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel") == NT - 1:
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")

    @triton.jit
    def _wait_xa(sync_ptr):
        # xa is long made by now; the flag says so (acquire: its stores are seen after it)
        while tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == 0:
            pass
        tl.debug_barrier()

    @triton.jit
    def _fused_a_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, xa_ptr, lb_ptr, a_ptr, ws_ptr,
                        cnt_ptr, sync_ptr, M, N, NP, K, KT, TILES_PER_SPLIT, stride_xm, stride_ym,
                        R, NTN, NTM, WS_A, BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
                        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
                        RP: tl.constexpr, PA: tl.constexpr, STEPS: tl.constexpr,
                        BMA: tl.constexpr, BKA: tl.constexpr, UNROLL: tl.constexpr,
                        PEEL: tl.constexpr, GATED: tl.constexpr, UP, I):
        # KS > 0: the K-sliced GEMM (one token tile, no split); else the split-K one. The xa
        # programs' partial sums sit in the workspace from float WS_A on, their count at
        # cnt[NTN * NTM] (after the GEMM tiles')
        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")                 # sync: ticket, ready,
        if ticket < PA:                                                    # tiles done
            # xa program `ticket`: layers/shrink's split-K A product, its K range the ticket's;
            # the one that stores xa raises the flag after every thread's store
            if _shrink_part(x_ptr, a_ptr, xa_ptr, ws_ptr + WS_A, cnt_ptr + NTN * NTM, 0, ticket,
                            1, M, K, R, stride_xm, STEPS, PA, BMA, RP, BKA, USE_ASM == 0):
                tl.debug_barrier()
                tl.atomic_xchg(sync_ptr + 1, 1, sem="release")
        else:
            g = ticket - PA
            pid_n, pid_m, pid_k = g % NTN, (g // NTN) % NTM, g // (NTN * NTM)
            n = _rows(pid_n, BN, UP, GATED)                                # rows of W
            m = pid_m * BM + tl.arange(0, BM)                              # tokens
            if KS > 0:
                acc = _ks_acc(x_ptr, w_ptr, s_ptr, gs_ptr, n, m, M, NP, K, KT, stride_xm, BN, KS,
                              USE_ASM)                                     # (BN, BM) fp32
                _wait_xa(sync_ptr)
                _store(acc, n, m, M, N, b_ptr, xa_ptr, lb_ptr, y_ptr, stride_ym, R,
                       HAS_BIAS, RP, USE_ASM, GATED, I)
                _tile_done(sync_ptr, NTN * NTM)
            else:
                acc = _sk_acc(x_ptr, w_ptr, s_ptr, gs_ptr, n, m, M, NP, K, KT,
                              pid_k * TILES_PER_SPLIT, TILES_PER_SPLIT, stride_xm, BN, USE_ASM,
                              UNROLL, PEEL)                                # (BN, BM) fp32
                # kernels._nvfp4_mm_kernel's fix-up: the tile's last split adds them in order
                acc, last = _fixup(acc, n, m, M, N, ws_ptr, cnt_ptr, pid_n, pid_m, pid_k, NTN, NTM,
                                   SPLIT_K)
                if last:
                    _wait_xa(sync_ptr)
                    _store(acc, n, m, M, N, b_ptr, xa_ptr, lb_ptr, y_ptr, stride_ym, R,
                           HAS_BIAS, RP, USE_ASM, GATED, I)
                    _tile_done(sync_ptr, NTN * NTM)


def nvfp4_mm_fused_a(x2: torch.Tensor, w: NVFP4Weight, A: torch.Tensor, B: torch.Tensor,
                     bias=None, gated: int = 0):
    """kernels.nvfp4_mm(x2, w, bias, lora=(x2 @ A^T, B), gated=gated) in one launch: x2 (M, K)
    bf16 with M <= MAX_M, A (R, K), B (N, R), R <= 128. Returns None where that launch does not
    apply (more tokens, the warp-specialized GEMM's tokens, no Triton, another dtype); the caller
    then makes xa itself."""
    M, K = x2.shape
    R, N, KT = A.shape[0], w.n, w.words.shape[0]
    if not (_use_triton(x2) and x2.dtype == torch.bfloat16 and M <= MAX_M and 0 < R <= 128
            and A.shape[1] == K and B.shape == (N, R) and x2.stride(1) == 1):
        return None
    if kernels.ws_choice(x2, w, gated=gated) is not None:
        return None
    kernels.check_gated(gated, w)
    cfg = mm_config(M, N, K)                                   # what kernels.nvfp4_mm would run
    BM, BN = cfg.pop("BM"), cfg.pop("BN")
    KS = cfg.pop("KS", 0)
    split, per_split = split_k(KT, cfg.pop("SPLIT_K", 1))
    RP = max(16, triton.next_power_of_2(R))
    BMA = max(16, triton.next_power_of_2(M))
    A = A.to(x2.dtype).contiguous()
    B = B.to(x2.dtype).contiguous()
    xa = torch.empty(M, R, dtype=x2.dtype, device=x2.device)
    y = torch.empty(M, gated or N, dtype=x2.dtype, device=x2.device)
    PA = triton.cdiv(K, A_STEPS * A_BK)
    NTN, NTM = triton.cdiv(N, BN), triton.cdiv(M, BM)
    ws_a = split * NTM * BM * N if split > 1 else 0            # the GEMM's partial sums first
    ws, cnt = workspace(x2.device, ws_a + PA * BMA * RP, NTN * NTM + 1)
    _fused_a_kernel[(PA + NTN * NTM * split,)](
        x2, w.words, w.scales, w.global_scale, bias if bias is not None else y, y, xa, B, A, ws,
        cnt, _sync(x2.device), M, N, w.words.shape[1], K, KT, per_split, x2.stride(0),
        y.stride(0), R, NTN, NTM, ws_a, BM=BM, BN=BN, KS=KS, SPLIT_K=split,
        HAS_BIAS=bias is not None, USE_ASM=kernels.asm_mode(x2.device),
        RP=RP, PA=PA, STEPS=A_STEPS, BMA=BMA, BKA=A_BK,
        UNROLL=cfg.pop("UNROLL", 1), PEEL=cfg.pop("PEEL", 0), GATED=bool(gated),
        UP=N // 2 if gated else 0, I=gated, **cfg)
    return y
