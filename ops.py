"""ops.py: the decoder's small ops beside the GEMM and the norm (kernels.py): rotary position embeddings with HF's
numerics, and two fused Triton kernels, each beside its PyTorch reference: one rotates q and k and writes k and v
to the KV cache during generation, one computes the MLP's SiLU(gate) * up in one pass.

    pytest tests/test_kernels.py -k "rope or silu"     # the kernels against the references (CPU: TRITON_INTERPRET=1)

Default and llama3 rope types only; no partial rotary, no NTK / YaRN scaling. Used by model.py.
"""
import math

import versions

versions.check()
import torch  # noqa: E402

from kernels import _use_triton, triton  # noqa: E402

if triton is not None:
    import triton.language as tl


def rope_inv_freq(cfg) -> torch.Tensor:
    """Inverse frequencies of a model.Config as HF computes them (default; llama3 smoothing when configured)."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = cfg.rope_scaling
    if s and s.get("rope_type", s.get("type")) == "llama3":
        factor, lo, hi, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        llama = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, llama)
    return inv


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype):
    """positions (B, T) -> cos, sin (B, 1, T, D) in dtype, computed in fp32 like HF."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)     # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                    # (B, T, D)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin



def rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots):
    """q, k, v (B, T, heads, D); cos, sin (B, T, D); cache_k/v (B, kv_heads, S, D); slots (T,). Writes the rotated k
    and v to the cache at `slots`; returns the rotated q as (B, heads, T, D)."""
    def rot(x):
        return apply_rope(x, cos[:, :, None], sin[:, :, None])
    cache_k.index_copy_(2, slots, rot(k).transpose(1, 2))
    cache_v.index_copy_(2, slots, v.transpose(1, 2))
    return rot(q).transpose(1, 2)


if triton is not None:
    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ck_ptr, cv_ptr, slot_ptr, T, HQ, HK,
                           sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, scb, sct, sob, soh, sot, scacheb, scacheh,
                           scaches, HALF: tl.constexpr):
        bt, h = tl.program_id(0), tl.program_id(1)           # one (token, head) vector per program
        b, t = (bt // T).to(tl.int64), bt % T
        i = tl.arange(0, HALF)
        dt = qo_ptr.dtype.element_ty
        if h < HQ + HK:                                       # q or k: rotate; products rounded to the dtype as in
            #                                                   torch's op-by-op reference (bf16: within an ulp of it)
            if h < HQ:
                src = q_ptr + b * sqb + t * sqt + h * sqh
                dst = qo_ptr + b * sob + h * soh + t * sot
            else:
                src = k_ptr + b * skb + t * skt + (h - HQ) * skh
                dst = ck_ptr + b * scacheb + (h - HQ) * scacheh + tl.load(slot_ptr + t) * scaches
            x1, x2 = tl.load(src + i).to(tl.float32), tl.load(src + HALF + i).to(tl.float32)
            cb, sb = cos_ptr + b * scb + t * sct, sin_ptr + b * scb + t * sct
            c1, c2 = tl.load(cb + i).to(tl.float32), tl.load(cb + HALF + i).to(tl.float32)
            s1, s2 = tl.load(sb + i).to(tl.float32), tl.load(sb + HALF + i).to(tl.float32)
            o1 = (x1 * c1).to(dt).to(tl.float32) + (-(x2 * s1)).to(dt).to(tl.float32)
            o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
            tl.store(dst + i, o1.to(dt))
            tl.store(dst + HALF + i, o2.to(dt))
        else:                                                 # v: copied into the cache
            src = v_ptr + b * svb + t * svt + (h - HQ - HK) * svh
            dst = cv_ptr + b * scacheb + (h - HQ - HK) * scacheh + tl.load(slot_ptr + t) * scaches
            tl.store(dst + i, tl.load(src + i))
            tl.store(dst + HALF + i, tl.load(src + HALF + i))


def rope_cache(q, k, v, cos, sin, cache_k, cache_v, slots):
    """rope_cache_ref in one launch (Triton on CUDA and under TRITON_INTERPRET=1), for generation only: no autograd."""
    D = q.shape[-1]
    half = D // 2
    usable = (_use_triton(q) and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
              and half & (half - 1) == 0 and all(t.stride(-1) == 1 for t in (q, k, v, cos, sin, cache_k))
              and cache_k.stride() == cache_v.stride() and cos.stride() == sin.stride() and q.dtype == cos.dtype)
    if not usable:
        return rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots)
    B, T, HQ, _ = q.shape
    HK = k.shape[2]
    qo = torch.empty(B, HQ, T, D, dtype=q.dtype, device=q.device)
    _rope_cache_kernel[(B * T, HQ + 2 * HK)](
        q, k, v, cos, sin, qo, cache_k, cache_v, slots, T, HQ, HK, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *cos.stride()[:2], *qo.stride()[:3], *cache_k.stride()[:3], HALF=half, num_warps=1)
    return qo


# ----------------------------------------------------------------------------------------------------------------
# SiLU(gate) * up in one pass (the MLP between gate_up and down), rounded like torch's two ops

def silu_mul_ref(gate, up):
    return torch.nn.functional.silu(gate) * up


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr):
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + row * stride_g + cols, mask=cols < N, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=cols < N, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)       # silu, rounded as torch does
        tl.store(y_ptr + row * N + cols, (s * u).to(y_ptr.dtype.element_ty), mask=cols < N)


def silu_mul(gate, up):
    """silu(gate) * up for (..., N) views (e.g. the two halves of a fused gate_up output). One Triton kernel for
    inference; with autograd on (training) the two torch ops, whose backward torch provides."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if not _use_triton(gate) or (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return silu_mul_ref(gate, up)
    N = gate.shape[-1]
    g2, u2 = gate.reshape(-1, N), up.reshape(-1, N)                              # views when rows are evenly strided
    g2, u2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (g2, u2))
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)              # (rows, N)
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(N, 1024))](g2, u2, y, N, g2.stride(0), u2.stride(0), BLOCK=1024)
    return y.view(gate.shape)
