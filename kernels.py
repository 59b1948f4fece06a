"""kernels.py: Triton kernels for NVFP4 weights (W4A16), tuned on Hopper, each beside its
reference. (The noisy RMSNorm and the other decoder ops live in layers/ops.py.)

    python -m bench kernels            # speed against torch bf16 on a GPU
    pytest tests/test_kernels.py       # numerics (CPU: TRITON_INTERPRET=1 on small shapes)

What is here
  pack_nvfp4(weight_packed, weight_scale, weight_global_scale) -> NVFP4Weight
                                   the kernel layout (gemm/layout.py)
  nvfp4_linear(x, w, bias=None)    y = x @ W_hat^T for any number of tokens; autograd gives dX
                                   (no dW: frozen)
  dequantize(w)                    W_hat (N, K) in bf16 (the large-M and backward paths use it with
                                   torch.matmul)
  *_ref                            plain PyTorch references (used on CPU and by the tests)

How the GEMM works. The H100 has no FP4 tensor cores, so weights are dequantized in registers and
multiplied on bf16 tensor cores. Operands are swapped (y^T = W_hat @ x^T): the weight tile is the
register-side wgmma operand and the tokens are the small N side, so M = 1..64 decode steps still use
the tensor cores. The checkpoint layout is rearranged once (pack_nvfp4) into tile-major 32-bit
words: a word holds the codes of 4 of the 8 blocks of 16 that a 128-wide K tile spans, for a pair of
adjacent K columns (the two bf16 lanes of a wgmma register), with the bits placed so that two of the
four bf16x2 outputs are one rotate + one AND and the other two are two rotates, an AND and a LOP3
(11 integer ops per 8 weights); one bf16x2 multiply applies the block scale. Why it is exact: the
3 magnitude bits land on bf16 bits 8..6 (exponent 1..0, mantissa 6), which is e2m1 * 2^-126
including the 0.5 subnormal; the fp8 scale byte shifted left by 4 is s * 2^-120 as bf16, times
2^127 gives s * 2^7; their product q * s * 2^-119 is exact in bf16 and the fp32 epilogue multiplies
by 2^119 / global_scale once. Split-K programs park partial sums in a workspace and the last one to
finish (a counter per output tile) writes the result, so a call is one launch; the epilogue can add
a LoRA term xa @ B^T (the rollout's adapters, xa = x @ A^T made before the call). The fix-up and
the epilogue live in gemm/epilogue.py, shared with gemm/fused_a.py.
1-8 tokens run the K-sliced kernel instead (16-32 weight rows over all of K, 4 warps each taking
every 4th K tile as the batch of a 3-D dot on mma.sync, summed once at the end: no workspace, no
fixup; see gemm/configs.mm_config).
Large M (>= LARGE_M tokens) dequantizes once and calls torch.matmul: cuBLAS wins there. On Hopper,
33..1023 tokens (WS_MIN_M..LARGE_M) run gemm/warp_specialized.py's warp-specialized GEMM where its
ws_config says it wins; else the kernel below.

Other GPUs (Ampere, Ada, Blackwell) run the same Triton kernels on the portable path (see hopper);
Hopper alone runs gemm/warp_specialized.py and the PTX with sm_90's bf16x2 multiply.
Leaves out: FP4 activations (Blackwell only), the LoRA A product inside the GEMM (gemm/fused_a.py
has it up to 64 tokens, opt-in), non-Hopper tuning, and the designs measured and dropped in
docs/KERNELS.md (cheaper split-K fixups, a CUDA-core GEMV, wider K-sliced tiles).
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import functools
import os

import torch

from gemm.configs import mm_config, split_k
from gemm.layout import (E2M1, INTERPRET, NVFP4Weight, code_ptx, lora_args, scale_ptx,
                         unpack_codes, workspace)
from util import versions

try:
    import triton
    import triton.language as tl
    versions.check("triton")
except ImportError as e:
    # CPU-only installs can still use the references; a wrong version is an error
    if "nanoqerl needs" in str(e):
        raise
    triton = None

if triton is not None:
    from gemm.epilogue import _dot, _fixup, _rows, _store

# any GPU takes the path a non-Hopper GPU takes (see hopper)
PORTABLE = os.environ.get("NANOQERL_PORTABLE") == "1"
# with TRITON_INTERPRET=1, also run the Triton kernels on CPU tensors (the tests do)
CPU_TRITON = False
# from this many tokens on, dequantize + cuBLAS is faster (python -m bench kernels)
LARGE_M = 1024
# above this many tokens (and below LARGE_M) Hopper may run gemm/warp_specialized.py's
# warp-specialized GEMM
WS_MIN_M = 32
# up to here the Triton GEMMs run gate_up (above, gemm/warp_specialized.py): nvfp4_mm(gated=) pays
GATED_MAX_M = 63


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or (INTERPRET and CPU_TRITON))


# --------------------------------------------------------------------------------------------------
# Which GPUs run what: the one place that decides (README, "Which GPUs run what")

@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def hopper(device: torch.device) -> bool:
    """Whether `device` takes the Hopper-only paths: gemm/warp_specialized.py's warp-specialized
    Gluon GEMM (33..1023 tokens) and the dequantization PTX with sm_90's bf16x2 multiply. Every
    other GPU (Ampere, Ada, Blackwell) takes the portable path: the Triton kernels alone, their PTX
    with an fma in place of that multiply (the same bits; the H100's tile configs fit each of these
    GPUs' shared memory, 99 KB on the RTX cards, as tests/test_portable.py checks by compiling
    them). NANOQERL_PORTABLE=1 (PORTABLE) sends a Hopper GPU down the portable path too, so that
    what other GPUs run is tested and timed on an H100."""
    if device.type != "cuda" or PORTABLE:
        return False
    return _capability(torch.cuda.current_device() if device.index is None
                       else device.index) == (9, 0)


def asm_mode(device: torch.device) -> int:
    """The kernels' USE_ASM on `device`: 0 the pure-Triton twin (the interpreter runs no PTX),
    1 Hopper's PTX, 2 the portable PTX."""
    return 0 if INTERPRET else 1 if hopper(device) else 2


# --------------------------------------------------------------------------------------------------
# The references (PyTorch, from the kernel layout of gemm/layout.py)

@functools.cache
def _e2m1_lut(device) -> torch.Tensor:
    return torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=device)


def dequantize_ref(w: NVFP4Weight, dtype=torch.float32) -> torch.Tensor:
    """W_hat (n, k) = q * (s / global_scale), from the kernel layout."""
    q = _e2m1_lut(w.words.device)[unpack_codes(w)[: w.n, : w.k]]
    s = (w.scales.view(torch.uint8).permute(1, 0, 2)
         .reshape(w.words.shape[1], -1))                                  # (Np, Kp/16) fp8 bytes
    s = s.view(torch.float8_e4m3fn)[: w.n, : w.k // 16].float()
    return (q * (s / w.global_scale).repeat_interleave(16, dim=1)).to(dtype)


def nvfp4_linear_ref(x: torch.Tensor, w: NVFP4Weight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: fp32 matmul with the exact dequantized weight, cast to x's dtype."""
    y = x.float() @ dequantize_ref(w).to(x.device).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# The GEMM kernel

if triton is not None:
    # the dequantization PTX (gemm/layout.py): Hopper's, with sm_90's bf16x2 multiply, and the
    # portable one (sm_80 on)
    _SCALE_ASM, _CODE_ASM = tl.constexpr(scale_ptx(False)), tl.constexpr(code_ptx(False))
    _SCALE_FMA, _CODE_FMA = tl.constexpr(scale_ptx(True)), tl.constexpr(code_ptx(True))

    @triton.jit
    def _e2m1_twin(words, sw0, sw1, BN: tl.constexpr):
        # pure-Triton twin of the PTX (the interpreter cannot run PTX): (BN, 16) words
        # -> (BN, 128) exact q * s
        a, b = tl.split(tl.reshape(words.to(tl.uint32, bitcast=True),
                                   (BN, 8, 2)))                         # (BN, 8): blocks 0-3, 4-7
        r = tl.arange(0, 8)[None, :, None]                              # block r, slot o = r % 4
        v = tl.where(r < 4, a[:, None, :], b[:, None, :])               # (BN, 8 r, 8 p)
        ra = tl.where(r % 4 == 0, 0,
                      tl.where(r % 4 == 1, 3, tl.where(r % 4 == 2, 6, 13))).to(tl.uint32)  # ROT
        rb = tl.where(r % 4 == 0, 0,
                      tl.where(r % 4 == 1, 3, tl.where(r % 4 == 2, 1, 2))).to(tl.uint32)
        mag = ((v >> ra) | (v << ((32 - ra) % 32))) & 0x01C001C0        # rotate right by ROT[o]
        bits = mag | (((v >> rb) | (v << ((32 - rb) % 32))) & 0x80008000)
        code = tl.reshape(tl.join(bits & 0xFFFF, bits >> 16),
                          (BN, 8, 16))                                  # (BN, r, c) bf16-lane bits
        e, m = (code >> 7) & 3, ((code >> 6) & 1).to(tl.float32)
        q = tl.where(e == 0, 0.5 * m,
                     tl.exp2((e.to(tl.int32) - 1).to(tl.float32)) * (1.0 + 0.5 * m))
        q = tl.where((code >> 15) != 0, -q, q)
        sw = tl.reshape(tl.join(sw0, sw1).to(tl.uint32, bitcast=True), (BN, 2, 1))
        s8 = sw >> (8 * tl.arange(0, 4))[None, None, :]
        s8 = (tl.reshape(s8 & 0xFF, (BN, 8)).to(tl.uint8)
              .to(tl.float8e4nv, bitcast=True).to(tl.float32))
        return tl.reshape(q * s8[:, :, None], (BN, 128)).to(tl.bfloat16)

    @triton.jit
    def _dequant_regs(words, sw0, sw1, BN: tl.constexpr, USE_ASM: tl.constexpr):
        # (BN, 16) words + the two scale words per row -> (BN, 128) bf16 q * s (times 2^-119 with
        # the PTX path).
        # USE_ASM (see asm_mode): 0 the pure-Triton twin, 1 Hopper's PTX, 2 the portable PTX
        # (same bits)
        if USE_ASM:
            m0, m1, m2, m3, m4, m5, m6, m7 = tl.inline_asm_elementwise(
                _SCALE_FMA if USE_ASM == 2 else _SCALE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r",
                [sw0, sw1], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
            sh: tl.constexpr = (BN, 16)
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _CODE_FMA if USE_ASM == 2 else _CODE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r" + ",r" * 18,
                [words, tl.broadcast_to(m0[:, None], sh), tl.broadcast_to(m1[:, None], sh),
                 tl.broadcast_to(m2[:, None], sh), tl.broadcast_to(m3[:, None], sh),
                 tl.broadcast_to(m4[:, None], sh), tl.broadcast_to(m5[:, None], sh),
                 tl.broadcast_to(m6[:, None], sh), tl.broadcast_to(m7[:, None], sh)],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
            j = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)),
                        tl.join(tl.join(w1, w5), tl.join(w3, w7)))
            # k = 16 r + c: no data movement
            return tl.reshape(tl.permute(j, (0, 2, 3, 4, 1)), (BN, 128))
        else:
            return _e2m1_twin(words, sw0, sw1, BN)

    @triton.jit
    def _sk_acc(x_ptr, w_ptr, s_ptr, gs_ptr, n, m, M, NP, K, KT, t0, TILES_PER_SPLIT, stride_xm,
                BN: tl.constexpr, USE_ASM: tl.constexpr, UNROLL: tl.constexpr, PEEL: tl.constexpr):
        # this split's K tiles t0.. of rows n and tokens m, scaled: (BN, BM) fp32
        kk = tl.arange(0, 128)
        wp = w_ptr + (t0 * NP + n[:, None]) * 16 + tl.arange(0, 16)[None, :]  # (BN, 16) words
        sp = s_ptr + (t0 * NP + n[:, None]) * 2 + tl.arange(0, 2)[None, :]    # (BN, 2) scale words
        xp = x_ptr + m[:, None] * stride_xm + t0 * 128 + kk[None, :]          # (BM, 128)
        acc = tl.zeros((BN, m.shape[0]), dtype=tl.float32)
        if PEEL:  # first K tile outside the loop: the accumulator enters it from a wgmma, not from
            # zeroing movs, so ptxas keeps the loop's wgmmas in flight (else it serializes them,
            # advisory C7515; see gemm/configs.mm_config)
            sw0, sw1 = tl.split(tl.load(sp))                                    # (BN,) int32 each
            xt = tl.load(xp, mask=(m[:, None] < M) & (t0 * 128 + kk[None, :] < K),
                         other=0.0)                                             # (BM, 128)
            acc = _dot(_dequant_regs(tl.load(wp), sw0, sw1, BN, USE_ASM), tl.trans(xt),
                       acc, USE_ASM)
            wp += NP * 16
            sp += NP * 2
            xp += 128
        for t in tl.range(t0 + PEEL, tl.minimum(t0 + TILES_PER_SPLIT, KT),
                          loop_unroll_factor=UNROLL):
            words = tl.load(wp)                                                 # (BN, 16) int32
            sw0, sw1 = tl.split(tl.load(sp))                                    # (BN,) int32 each
            xt = tl.load(xp, mask=(m[:, None] < M) & (t * 128 + kk[None, :] < K),
                         other=0.0)                                             # (BM, 128)
            wt = _dequant_regs(words, sw0, sw1, BN, USE_ASM)                    # (BN, 128) bf16
            acc = _dot(wt, tl.trans(xt), acc, USE_ASM)                          # (BN, BM) fp32
            wp += NP * 16
            sp += NP * 2
            xp += 128
        return acc * ((2.0 ** 119 if USE_ASM else 1.0) / tl.load(gs_ptr))

    @triton.jit
    def _nvfp4_mm_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, xa_ptr, lb_ptr,
                         M, N, NP, K, KT, TILES_PER_SPLIT, stride_xm, stride_ym, R,
                         BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, RP: tl.constexpr = 0,
                         UNROLL: tl.constexpr = 1, PEEL: tl.constexpr = 0,
                         GATED: tl.constexpr = False, UP=0, I=0):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = _rows(pid_n, BN, UP, GATED)                               # rows of W (output features)
        m = pid_m * BM + tl.arange(0, BM)                             # tokens
        acc = _sk_acc(x_ptr, w_ptr, s_ptr, gs_ptr, n, m, M, NP, K, KT, pid_k * TILES_PER_SPLIT,
                      TILES_PER_SPLIT, stride_xm, BN, USE_ASM, UNROLL, PEEL)       # (BN, BM)
        acc, last = _fixup(acc, n, m, M, N, ws_ptr, cnt_ptr, pid_n, pid_m, pid_k,
                           tl.num_programs(0), tl.num_programs(1), SPLIT_K)
        if last:
            _store(acc, n, m, M, N, b_ptr, xa_ptr, lb_ptr, y_ptr, stride_ym, R,
                   HAS_BIAS, RP, USE_ASM, GATED, I)

    @triton.jit
    def _ks_acc(x_ptr, w_ptr, s_ptr, gs_ptr, n, m, M, NP, K, KT, stride_xm,
                BN: tl.constexpr, KS: tl.constexpr, USE_ASM: tl.constexpr):
        # K split inside the program: slice s takes K tiles s, s + KS, s + 2 KS, ... as the batch
        # index of a 3-D dot (Triton runs it on mma.sync with one warp per slice); the slices are
        # summed once at the end, so no workspace, counter or second pass over partial sums.
        # Returns the tile of rows n and tokens m, scaled: (BN, BM) fp32
        ks, kk = tl.arange(0, KS), tl.arange(0, 128)
        acc = tl.zeros((KS, BN, m.shape[0]), dtype=tl.float32)
        for i in range(0, tl.cdiv(KT, KS)):
            t = i * KS + ks                                                  # (KS,) K tiles
            live = (t < KT)[:, None, None]
            wo = (t[:, None, None] * NP + n[None, :, None])                  # (KS, BN, 1) tile rows
            words = tl.load(w_ptr + wo * 16 + tl.arange(0, 16)[None, None, :],
                            mask=live, other=0)                              # (KS, BN, 16)
            sc = tl.load(s_ptr + wo * 2 + tl.arange(0, 2)[None, None, :],
                         mask=live, other=0)                                 # (KS, BN, 2)
            sw0, sw1 = tl.split(tl.reshape(sc, (KS * BN, 2)))
            wt = _dequant_regs(tl.reshape(words, (KS * BN, 16)), sw0, sw1,
                               KS * BN, USE_ASM)                             # (KS * BN, 128)
            k = t[:, None, None] * 128 + kk[None, :, None]                   # (KS, 128, 1)
            xt = tl.load(x_ptr + m[None, None, :] * stride_xm + k,
                         mask=(m[None, None, :] < M) & (k < K), other=0.0)
            acc = _dot(tl.reshape(wt, (KS, BN, 128)), xt, acc, USE_ASM)      # (KS, BN, BM) fp32
        return tl.sum(acc, 0) * ((2.0 ** 119 if USE_ASM else 1.0) / tl.load(gs_ptr))

    @triton.jit
    def _nvfp4_mm_ks_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, xa_ptr, lb_ptr,
                            M, N, NP, K, KT, stride_xm, stride_ym, R,
                            BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, RP: tl.constexpr = 0,
                            GATED: tl.constexpr = False, UP=0, I=0):
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        n = _rows(pid_n, BN, UP, GATED)                                      # rows of W
        m = pid_m * BM + tl.arange(0, BM)                                    # tokens
        acc = _ks_acc(x_ptr, w_ptr, s_ptr, gs_ptr, n, m, M, NP, K, KT, stride_xm, BN, KS,
                      USE_ASM)                                               # (BN, BM)
        _store(acc, n, m, M, N, b_ptr, xa_ptr, lb_ptr, y_ptr, stride_ym, R,
               HAS_BIAS, RP, USE_ASM, GATED, I)

    @triton.jit
    def _nvfp4_dequant_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, N, NP, K, KT,
                              BN: tl.constexpr, TPP: tl.constexpr, USE_ASM: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        # TPP K tiles of 128
        for t in range(tl.program_id(1) * TPP, tl.minimum(tl.program_id(1) * TPP + TPP, KT)):
            words = tl.load(w_ptr + (t * NP + n[:, None]) * 16
                            + tl.arange(0, 16)[None, :])                        # (BN, 16)
            sw0, sw1 = tl.split(tl.load(s_ptr + (t * NP + n[:, None]) * 2
                                        + tl.arange(0, 2)[None, :]))
            wt = _dequant_regs(words, sw0, sw1, BN, USE_ASM).to(tl.float32)     # (BN, 128)
            wt = wt * ((2.0 ** 119 if USE_ASM else 1.0) / tl.load(gs_ptr))
            k = t * 128 + tl.arange(0, 128)
            tl.store(out_ptr + n[:, None] * K + k[None, :], wt.to(tl.bfloat16),
                     mask=(n[:, None] < N) & (k[None, :] < K))


# --------------------------------------------------------------------------------------------------
# Launch: the tile config of gemm/configs.py, split-K, workspace

def nvfp4_mm(x2: torch.Tensor, w: NVFP4Weight, bias=None, config: dict | None = None,
             use_asm: bool | None = None, lora=None, gated: int = 0):
    """(M, K) bf16 -> (M, N) with the Triton GEMM (any M; see nvfp4_linear for the dispatch).

    config: a dict as mm_config returns (BM, BN, SPLIT_K, ... or, for the K-sliced kernel, BM, BN,
    KS, ...).
    lora=(xa, B): also add xa @ B^T in the epilogue (xa = x @ A^T (M, R), B (N, R), R <= 128; the
    rollout's LoRA).
    gated=I: w is a fused gate_up (gate rows [0, N/2), up rows [N/2, N)); returns
    silu(gate) * up (M, I), I <= N/2, from the epilogue (Triton GEMMs only: GATED_MAX_M tokens at
    most is where they run for gate_up).
    use_asm=False runs the pure-Triton dequant twin on the GPU too (the tests compare the two)."""
    (M, K), (xa, lb, R) = x2.shape, lora_args(x2, w, lora)
    check_gated(gated, w)
    if (wcfg := ws_choice(x2, w, config, use_asm, gated)) is not None:
        # Hopper, 33..1023 tokens, enough tiles: warp-specialized
        return _ws().ws_mm(x2, w, bias, wcfg, lora=lora)
    N, KT = w.n, w.words.shape[0]
    # fewer warps than K slices: wrong sums (H100)
    if config and config.get("num_warps", 4) % config.get("KS", 1):
        raise ValueError(f"the K-sliced kernel needs num_warps a multiple of KS, got {config}")
    cfg = dict(config or mm_config(M, N, K))
    BM, BN = cfg.pop("BM"), cfg.pop("BN")
    ptx = 1 if hopper(x2.device) else 2  # which PTX, where PTX runs (see asm_mode)
    asm = (0 if INTERPRET else ptx) if use_asm is None else ptx * bool(use_asm)
    RP = max(16, triton.next_power_of_2(R)) if R else 0
    y = torch.empty(M, gated or N, dtype=x2.dtype, device=x2.device)
    # gated: BN / 2 rows of each half, same grid
    cfg.update(GATED=bool(gated), UP=N // 2 if gated else 0, I=gated)
    if "KS" in cfg:  # K sliced inside the program: no split-K workspace
        _nvfp4_mm_ks_kernel[(-(-N // BN), -(-M // BM))](
            x2, w.words, w.scales, w.global_scale, bias if bias is not None else y, y, xa, lb,
            M, N, w.words.shape[1], K, KT, x2.stride(0), y.stride(0), R,
            BM=BM, BN=BN, HAS_BIAS=bias is not None, RP=RP, USE_ASM=asm, **cfg)
        return y
    split, per_split = split_k(KT, cfg.pop("SPLIT_K"))
    grid = (-(-N // BN), -(-M // BM), split)
    ws, cnt = workspace(x2.device, split * grid[1] * BM * N if split > 1 else 0, grid[0] * grid[1])
    _nvfp4_mm_kernel[grid](
        x2, w.words, w.scales, w.global_scale, bias if bias is not None else y, y, ws, cnt, xa, lb,
        M, N, w.words.shape[1], K, KT, per_split, x2.stride(0), y.stride(0), R,
        BM=BM, BN=BN, SPLIT_K=split, HAS_BIAS=bias is not None, RP=RP, USE_ASM=asm, **cfg)
    return y


def check_gated(gated: int, w: NVFP4Weight) -> None:
    """gated=I (SiLU x up of I columns) needs a fused gate_up: gate and up rows padded alike."""
    if gated and not (0 < gated <= w.n // 2 and w.n % 256 == 0):
        raise ValueError(f"gated={gated} needs gate and up rows of a fused weight padded alike "
                         f"(N = {w.n})")


def ws_choice(x2: torch.Tensor, w: NVFP4Weight, config=None, use_asm=None,
              gated: int = 0) -> dict | None:
    """gemm/warp_specialized.py's config where nvfp4_mm runs x2 (M, K) through the warp-specialized
    GEMM (Hopper, 33..1023 tokens, enough tiles, no config or dequant forced, no gated epilogue);
    None where it runs this file's kernels."""
    M = x2.shape[0]
    if config is not None or M <= WS_MIN_M or use_asm is not None or gated or not hopper(x2.device):
        return None
    ws = _ws()
    return ws.ws_config(M, w.n, x2.shape[1]) if ws is not None and ws.usable(x2) else None


@functools.cache
def _ws():
    try:
        from gemm import warp_specialized as kernels_ws
    except ImportError:
        return None
    return kernels_ws


def dequantize(w: NVFP4Weight, dtype=torch.bfloat16) -> torch.Tensor:
    """W_hat (n, k) in bf16 from the kernel layout (Triton on GPU / interpreter, the reference
    otherwise)."""
    if not _use_triton(w.words):
        return dequantize_ref(w, dtype)
    out = torch.empty(w.n, w.k, dtype=torch.bfloat16, device=w.words.device)
    KT, tpp = w.words.shape[0], 4
    _nvfp4_dequant_kernel[(-(-w.n // 64), -(-KT // tpp))](
        w.words, w.scales, w.global_scale, out, w.n, w.words.shape[1], w.k, KT, BN=64, TPP=tpp,
        USE_ASM=asm_mode(w.words.device), num_warps=4)
    return out.to(dtype)


def _check_linear(x: torch.Tensor, w: NVFP4Weight, bias):
    if not isinstance(w, NVFP4Weight):
        raise TypeError("w must be an NVFP4Weight (use gemm/layout.pack_nvfp4), "
                        f"got {type(w).__name__}")
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K = {w.k}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be a float tensor, got {x.dtype}")
    if x.device != w.words.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.words.device}")
    if w.words.dtype != torch.int32 or not (w.words.is_contiguous() and w.scales.is_contiguous()):
        raise ValueError("the NVFP4Weight tensors must be contiguous int32 "
                         "(build it with gemm/layout.pack_nvfp4)")
    if bias is not None and tuple(bias.shape) != (w.n,):
        raise ValueError(f"bias must have shape ({w.n},), got {tuple(bias.shape)}")


class _NVFP4Linear(torch.autograd.Function):
    """y = x @ W_hat^T (+ b). Backward: dX = dY @ W_hat (the base is frozen: no dW); db if the bias
    wants it."""

    @staticmethod
    def forward(ctx, x, w: NVFP4Weight, bias):
        ctx.w = w
        x2 = x.reshape(-1, x.shape[-1])
        if not _use_triton(x) or x.dtype != torch.bfloat16:
            y = nvfp4_linear_ref(x2, w, bias)
        elif x2.shape[0] >= LARGE_M:  # compute-bound: dequantize once, cuBLAS does the rest
            y = torch.nn.functional.linear(x2, dequantize(w), bias)
        else:
            y = nvfp4_mm(x2.contiguous(), w, bias)
        # 2-D: not a view (LoRA adds in place)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w.n)

    @staticmethod
    def backward(ctx, dy):
        w = ctx.w
        dy2 = dy.reshape(-1, w.n)
        if _use_triton(dy) and dy.dtype == torch.bfloat16:
            dx = dy2 @ dequantize(w)
        else:
            dx = (dy2.float() @ dequantize_ref(w).to(dy.device)).to(dy.dtype)
        db = dy2.float().sum(0).to(dy.dtype) if ctx.needs_input_grad[2] else None
        return dx.reshape(*dy.shape[:-1], w.k), None, db


def nvfp4_linear(x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W_hat^T (+ bias) for x (..., K). Triton on CUDA bf16 (and under TRITON_INTERPRET=1),
    else the reference."""
    _check_linear(x, w, bias)
    return _NVFP4Linear.apply(x, w, bias)
