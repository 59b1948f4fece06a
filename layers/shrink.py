"""shrink.py: the LoRA A product of a decode step, xa = x @ A^T, as ONE Triton launch beside its
PyTorch reference.

    pytest tests/test_kernels.py -k shrink                 # against the reference
    python -m bench kernels --parts lora                   # against cuBLAS's ways, on a GPU

At decode sizes (M <= 64 tokens, R <= 128 adapter rows, K up to 27648) cuBLAS runs x @ A^T as a
split-K GEMV and a separate reduction: two launches of about 5 us each where reading A takes under
1 us (docs/BENCHMARKS.md). Here the K range is split over programs that park fp32 partial sums in a
workspace; the last program to finish (a counter per token block, reset by that program) adds them
up in program order, so the result does not depend on which program ends last, and writes xa in
x's dtype. The same split-K fix-up as kernels.py's GEMM, without the dequantization.
layers/linear.base_linear takes it for the generation snapshot's A product (a_product) up to
SHRINK_M tokens, cuBLAS's x @ A^T above: by default 16, where the 7B decode step on an H100 was
measured faster with it (the adapter's cost 22-23% against cuBLAS's 28-29% at batch 1, 19% against
24% at 16, in two sessions; at 64, 19-20% against 19%: docs/BENCHMARKS.md). NANOQERL_LORA_SHRINK=1
takes it at every size, =0 never.

The A products of q/k/v and of gate/up read the output of the RMSNorm just before them: with
NANOQERL_LORA_NORM=1 that norm computes them in its own launch (rms_norm_lora), so those two take no
launch of their own. Each program takes a block of tokens and a range of columns: it sums the
squares of its tokens' whole rows, then normalizes its own columns, stores them, and multiplies
them by the same columns of A; the partial products meet as in lora_shrink. (A first version gave
each program a block of A's rows and the whole row to walk: 6 programs for q/k/v at batch 1, and
the decode step 1.75 ms slower, experiments/results/rollout-lora-h100/lora-paths-1.log.) This one
still loses to the shrink alone: the adapter's cost 32.5% against 23.4% at batch 1, 31% against 19%
at 16 (lora-paths-r2-*.log); off unless NANOQERL_LORA_NORM=1.
With NANOQERL_LORA_ATTN=1 the decode attention's merge launch makes o_proj's A product the same way
(layers/attention.decode_attention(a_next=)), where that launch runs (batches below the SM count).
With NANOQERL_LORA_FUSED=1 a Triton GEMM of up to 64 tokens makes its own A product in its launch
(gemm/fused_a), where no launch before made it; off by default (slower so far, gemm/fused_a says
why).
"""
import os

import torch

from gemm.layout import workspace
from kernels import _use_triton, triton
from layers.ops import rms_norm, rms_norm_ref

if triton is not None:
    import triton.language as tl

# K columns a program step reads, and the most K steps one program takes
BK = 128
STEPS_PER_PROGRAM = 4
# another config, timed beside this one by `python -m bench kernels --parts lora`: for q/k/v's 96
# rows (padded to 128) the one above spills 784 bytes a thread on sm_90, this one none
NO_SPILL = {"BK": 32, "STEPS": 16, "num_warps": 8}
# the config a_product's lora_shrink takes (None: the one above; the rollout benchmark's path
# "shrink2" sets NO_SPILL)
CONFIG = None
# up to how many tokens the generation snapshot's A product runs through lora_shrink (read at every
# call): 16 unless NANOQERL_LORA_SHRINK says always (1) or never (0); 17-32 not measured yet
SHRINK_M = {"1": 1 << 30, "0": 0}.get(os.environ.get("NANOQERL_LORA_SHRINK"), 16)
# the A products of q/k/v and gate/up inside the norm before them (layers/linear.norm_for)
NORM = os.environ.get("NANOQERL_LORA_NORM") == "1"
# o_proj's A product inside the decode attention's merge launch (layers/linear.next_a)
ATTN = os.environ.get("NANOQERL_LORA_ATTN") == "1"
# up to 64 tokens, each A product inside its GEMM's own launch (gemm/fused_a, layers/linear)
FUSED = os.environ.get("NANOQERL_LORA_FUSED") == "1"
# token rows a program of rms_norm_lora takes (tl.dot's smallest side); each program reads its
# token rows whole for their sum of squares, so it takes fewer, longer column ranges than the shrink
NORM_BM = 16
# columns a step of rms_norm_lora (256 a program) and its warps: with 128 columns a step, 4 warps,
# the (16 x 128) by (128 x 128) product of q/k/v's three adapters took 255 registers a thread and
# spilled 980 bytes (compiled offline for sm_90: tests/test_portable.py), the likely reason its
# launch lost to the norm and the shrink apart; 32 columns and 8 warps take 108 and spill nothing
NORM_BK = 32
NORM_STEPS = 8
NORM_WARPS = 8


def lora_shrink_ref(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ A (R, K)^T -> (M, R) in x's dtype, accumulated in fp32."""
    return (x.float() @ A.float().t()).to(x.dtype)


if triton is not None:
    @triton.jit
    def _shrink_part(x_ptr, a_ptr, y_ptr, ws_ptr, cnt_ptr, pid_m, pid_k, NPM, M, K, R, stride_xm,
                     STEPS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                     BR: tl.constexpr, BK: tl.constexpr, ON_CPU: tl.constexpr):
        # program (pid_m, pid_k) of NPM token blocks x SPLIT column ranges: its share of the
        # token block's x @ A^T; the last of the SPLIT adds them in program order and stores y.
        # Returns whether this program stored y (gemm/fused_a raises its flag after it)
        m = pid_m * BM + tl.arange(0, BM)                                  # tokens
        r = tl.arange(0, BR)                                               # adapter rows
        kk = tl.arange(0, BK)
        acc = tl.zeros((BR, BM), dtype=tl.float32)
        for s in range(0, STEPS):
            k = (pid_k * STEPS + s) * BK + kk                              # (BK,) columns
            a = tl.load(a_ptr + r[:, None] * K + k[None, :],
                        mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)   # (BR, BK)
            xt = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                         mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)  # (BM, BK)
            if ON_CPU:  # the interpreter multiplies bf16 operands wrongly; fp32 holds them
                acc = tl.dot(a.to(tl.float32), tl.trans(xt).to(tl.float32), acc)
            else:
                acc = tl.dot(a, tl.trans(xt), acc)                         # (BR, BM) fp32
        out_mask = (r[:, None] < R) & (m[None, :] < M)
        y = y_ptr + m[None, :] * R + r[:, None]                            # (BR, BM) of (M, R)
        last = True
        if SPLIT > 1:
            mp = NPM * BM                                                  # padded token count
            park = ws_ptr + (pid_k * mp + m[None, :]) * BR + r[:, None]
            tl.store(park, acc)
            tl.debug_barrier()
            last = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel") == SPLIT - 1
            if last:
                # the last one adds every program's partial sum, in program order
                acc = tl.zeros((BR, BM), dtype=tl.float32)
                for p in range(0, SPLIT):
                    acc += tl.load(ws_ptr + (p * mp + m[None, :]) * BR + r[:, None],
                                   cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + pid_m, 0, sem="relaxed")      # ready for the next launch
        if last:
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        return last

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, y_ptr, ws_ptr, cnt_ptr, M, K, R, stride_xm,
                       STEPS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                       BR: tl.constexpr, BK: tl.constexpr, ON_CPU: tl.constexpr):
        _shrink_part(x_ptr, a_ptr, y_ptr, ws_ptr, cnt_ptr, tl.program_id(0), tl.program_id(1),
                     tl.num_programs(0), M, K, R, stride_xm, STEPS, SPLIT, BM, BR, BK, ON_CPU)


def _block(n: int) -> int:
    """The power of two >= n, at least 16 (tl.dot's smallest side)."""
    return max(16, 1 << (n - 1).bit_length())


def lora_shrink(x: torch.Tensor, A: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x (M, K) @ A (R, K)^T -> (M, R) in x's dtype: one launch (Triton) for bf16 / fp16 x and
    R <= 128, else, or where Triton does not run, the reference. config (benchmarks): BK, STEPS
    (the most K steps a program takes), num_warps, in place of BK, STEPS_PER_PROGRAM and 4."""
    M, K = x.shape
    R = A.shape[0]
    half = x.dtype in (torch.bfloat16, torch.float16)
    if not (_use_triton(x) and half and R <= 128 and A.shape[1] == K and x.stride(1) == 1):
        return lora_shrink_ref(x, A)
    A = A.to(x.dtype).contiguous()
    cfg = {"BK": BK, "STEPS": STEPS_PER_PROGRAM, "num_warps": 4, **(config or {})}
    BM, BR = min(_block(M), 64), _block(R)
    tiles = triton.cdiv(K, cfg["BK"])
    split = triton.cdiv(tiles, cfg["STEPS"])
    steps = triton.cdiv(tiles, split)
    grid = (triton.cdiv(M, BM), split)
    ws, cnt = workspace(x.device, split * grid[0] * BM * BR if split > 1 else 0, grid[0])
    y = torch.empty(M, R, device=x.device, dtype=x.dtype)
    _shrink_kernel[grid](x, A, y, ws, cnt, M, K, R, x.stride(0), STEPS=steps, SPLIT=split, BM=BM,
                         BR=BR, BK=cfg["BK"], ON_CPU=not x.is_cuda, num_warps=cfg["num_warps"])
    return y


def a_product(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """The generation snapshot's A product, x (M, K) @ A (R, K)^T: lora_shrink up to SHRINK_M
    tokens, else cuBLAS."""
    return lora_shrink(x, A, CONFIG) if x.shape[0] <= SHRINK_M else x @ A.t()


# --------------------------------------------------------------------------------------------------
# The RMSNorm with the next group's A product in the same launch

def rms_norm_lora_ref(x, weight, eps: float, noise, residual, A):
    """(y, h, xa): layers/ops.rms_norm_ref's y and h = x + residual (None without residual), and
    xa = y @ A^T (M, R) for x (..., H), A (R, H)."""
    out = rms_norm_ref(x, weight, eps, noise, residual)
    y, h = out if residual is not None else (out, None)
    return y, h, lora_shrink_ref(y.reshape(-1, y.shape[-1]), A)


if triton is not None:
    @triton.jit
    def _residual_tile(x_ptr, r_ptr, offs, inb, HAS_RES: tl.constexpr):
        # h = x (+ residual, summed in fp32 and rounded once, as ops.rms_norm does): (BM, BK)
        h = tl.load(x_ptr + offs, mask=inb, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + offs, mask=inb, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        return h

    @triton.jit
    def _norm_lora_kernel(x_ptr, r_ptr, w_ptr, z_ptr, y_ptr, h_ptr, a_ptr, xa_ptr, ws_ptr, cnt_ptr,
                          M, H, R, eps, STEPS: tl.constexpr, SPLIT: tl.constexpr,
                          HAS_RES: tl.constexpr, HAS_NOISE: tl.constexpr, BM: tl.constexpr,
                          BR: tl.constexpr, BK: tl.constexpr, ON_CPU: tl.constexpr):
        pid_m, pid_k = tl.program_id(0), tl.program_id(1)
        m = pid_m * BM + tl.arange(0, BM)                                  # tokens
        r = tl.arange(0, BR)                                               # rows of A
        kk = tl.arange(0, BK)
        row = m[:, None].to(tl.int64) * H                                  # (BM, 1)
        # pass 1, over the whole row: each token's sum of squares of h = x (+ residual, rounded
        # as ops.rms_norm does). Every program of the token block repeats it: the rows are a few
        # KB and come from L2, where waiting for another program's sum would take a launch.
        ss = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + kk
            inb = (m[:, None] < M) & (k[None, :] < H)                      # (BM, BK)
            hf = _residual_tile(x_ptr, r_ptr, row + k[None, :], inb, HAS_RES).to(tl.float32)
            ss += tl.sum(hf * hf, axis=1)
        rstd = 1.0 / tl.sqrt(ss / H + eps)                                 # (BM,)
        # pass 2, over this program's columns only: store h and y = (w + z) * round(h * rstd)
        # there, and add their share of xa = y A^T
        acc = tl.zeros((BM, BR), dtype=tl.float32)
        for s in range(0, STEPS):
            k = (pid_k * STEPS + s) * BK + kk                              # (BK,) columns
            inb = (m[:, None] < M) & (k[None, :] < H)
            h = _residual_tile(x_ptr, r_ptr, row + k[None, :], inb, HAS_RES)
            if HAS_RES:
                tl.store(h_ptr + row + k[None, :], h, mask=inb)
            w = tl.load(w_ptr + k, mask=k < H, other=0.0).to(tl.float32)
            if HAS_NOISE:
                # weight + noise stays fp32, as in ops.rms_norm
                w += tl.load(z_ptr + k, mask=k < H, other=0.0).to(tl.float32)
            hn = (h.to(tl.float32) * rstd[:, None]).to(h.dtype).to(tl.float32)
            y = (w[None, :] * hn).to(y_ptr.dtype.element_ty)              # (BM, BK)
            tl.store(y_ptr + row + k[None, :], y, mask=inb)
            a = tl.load(a_ptr + r[:, None] * H + k[None, :],
                        mask=(r[:, None] < R) & (k[None, :] < H), other=0.0)    # (BR, BK)
            if ON_CPU:  # the interpreter multiplies bf16 operands wrongly; fp32 holds them
                acc = tl.dot(y.to(tl.float32), tl.trans(a).to(tl.float32), acc)
            else:
                acc = tl.dot(y, tl.trans(a), acc)                          # (BM, BR) fp32
        out = xa_ptr + m[:, None] * R + r[None, :]                         # (BM, BR) of (M, R)
        out_mask = (m[:, None] < M) & (r[None, :] < R)
        if SPLIT > 1:
            # lora_shrink's fix-up: park the partial sum; the token block's last program adds
            # them all in program order (the same bits whichever program ends last)
            mp = tl.num_programs(0) * BM                                   # padded token count
            tl.store(ws_ptr + (pid_k * mp + m[:, None]) * BR + r[None, :], acc)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel")
            if done == SPLIT - 1:
                acc = tl.zeros((BM, BR), dtype=tl.float32)
                for p in range(0, SPLIT):
                    acc += tl.load(ws_ptr + (p * mp + m[:, None]) * BR + r[None, :],
                                   cache_modifier=".cg")
                tl.store(out, acc.to(xa_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_m, 0, sem="relaxed")      # ready for the next launch
        else:
            tl.store(out, acc.to(xa_ptr.dtype.element_ty), mask=out_mask)


def rms_norm_lora(x, weight, eps: float, noise, residual, A):
    """ops.rms_norm (residual add, AQN noise) and the product of its output with A (R, H) in one
    launch, for generation (no gradient): returns (y (..., H), h (..., H) or None without
    residual, xa (M, R) in x's dtype). The columns are split over programs as in lora_shrink, each
    program normalizing its own; where the kernel does not run (a gradient, no Triton, R > 128,
    not bf16 / fp16): the two steps apart, ops.rms_norm then a_product."""
    H = x.shape[-1]
    R = A.shape[0]
    half = x.dtype in (torch.bfloat16, torch.float16)
    if not (_use_triton(x) and half and R <= 128 and A.shape[1] == H) or torch.is_grad_enabled():
        out = rms_norm(x, weight, eps, noise, residual)
        y, h = out if residual is not None else (out, None)
        return y, h, a_product(y.reshape(-1, H), A)
    x2 = x.reshape(-1, H).contiguous()                                     # (M, H)
    M = x2.shape[0]
    r2 = residual.reshape(-1, H).contiguous() if residual is not None else x2
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else x2
    xa = torch.empty(M, R, device=x.device, dtype=x.dtype)
    z = noise.contiguous() if noise is not None else weight
    A = A.to(x.dtype).contiguous()
    BM, BR = NORM_BM, _block(R)
    tiles = triton.cdiv(H, NORM_BK)
    split = triton.cdiv(tiles, NORM_STEPS)
    steps = triton.cdiv(tiles, split)
    grid = (triton.cdiv(M, BM), split)
    ws, cnt = workspace(x.device, split * grid[0] * BM * BR if split > 1 else 0, grid[0])
    _norm_lora_kernel[grid](x2, r2, weight, z, y, h, A, xa, ws, cnt, M, H, R, eps, STEPS=steps,
                            SPLIT=split, HAS_RES=residual is not None,
                            HAS_NOISE=noise is not None, BM=BM, BR=BR, BK=NORM_BK,
                            ON_CPU=not x.is_cuda, num_warps=NORM_WARPS)
    return (y.reshape(x.shape), h.reshape(x.shape) if residual is not None else None, xa)
