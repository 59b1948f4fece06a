"""ops.py: the decoder's ops beside the NVFP4 GEMM (kernels.py), each Triton kernel beside its
PyTorch reference:
  rms_norm(x, weight, eps, noise=None, residual=None)
                               (residual add +) RMSNorm with weight + noise (AQN), fwd + bwd
  rope_cos_sin / apply_rope    rotary position embeddings with HF's numerics;
                               rope(x, cos, sin) the same, fwd + bwd
  rope_cache(q, k, v, ...)     rotate q and k and write k and v to the KV cache while generating
  silu_mul(gu, n, up_off)      the MLP's SiLU(gate) * up from the fused gate_up output, fwd + bwd
(the rollout's sampler is in sampler.py)

    pytest tests/test_kernels.py -k "rms or rope or silu"   # against the references

Default and llama3 rope types only; no partial rotary, no NTK / YaRN scaling. Used by model.py.
"""
import math

import torch

from kernels import _use_triton, triton

if triton is not None:
    import triton.language as tl


def rope_inv_freq(cfg) -> torch.Tensor:
    """Inverse frequencies of a model.Config as HF computes them (default; llama3 smoothing when
    configured)."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = cfg.rope_scaling
    if s and s.get("rope_type", s.get("type")) == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
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
    """Reference (HF's op-by-op numerics): x (B, heads, T, D), cos / sin (B, 1, T, D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


if triton is not None:
    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2, dt: tl.constexpr, BACKWARD: tl.constexpr):
        # the two halves of a rotated head vector, each product rounded to dt as in torch's op-by-op
        # reference (exact where the kernel is compiled with enable_fp_fusion=False: else a product
        # and the sum can become one FMA); BACKWARD: the transpose, dx1 = dy1 c1 + dy2 s2, dx2 = dy2
        # c2 - dy1 s1
        if BACKWARD:
            o1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s2).to(dt).to(tl.float32)
            o2 = (x2 * c2).to(dt).to(tl.float32) + (-(x1 * s1)).to(dt).to(tl.float32)
        else:
            o1 = (x1 * c1).to(dt).to(tl.float32) + (-(x2 * s1)).to(dt).to(tl.float32)
            o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        return o1, o2

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, HEADS,
                     sxb, sxh, sxt, scb, sct, syb, syh, syt,
                     BACKWARD: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr):
        bt, hb = tl.program_id(0), tl.program_id(1)           # (token, HB heads) per program
        b, t = (bt // T).to(tl.int64), bt % T
        h = (hb * HB + tl.arange(0, HB))[:, None]             # (HB, 1)
        i = tl.arange(0, HALF)[None, :]                       # (1, HALF)
        hm = h < HEADS
        dt = y_ptr.dtype.element_ty
        src, dst = x_ptr + b * sxb + t * sxt + h * sxh, y_ptr + b * syb + t * syt + h * syh
        x1 = tl.load(src + i, mask=hm).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=hm).to(tl.float32)
        cb, sb = cos_ptr + b * scb + t * sct, sin_ptr + b * scb + t * sct
        c1, c2 = tl.load(cb + i).to(tl.float32), tl.load(cb + HALF + i).to(tl.float32)
        s1, s2 = tl.load(sb + i).to(tl.float32), tl.load(sb + HALF + i).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, dt, BACKWARD)
        tl.store(dst + i, o1.to(dt), mask=hm)
        tl.store(dst + HALF + i, o2.to(dt), mask=hm)


def _rope_launch(x, cos, sin, backward: bool):
    B, Hh, T, D = x.shape
    # (B, heads, T, D), token-major
    y = torch.empty(B, T, Hh, D, dtype=x.dtype, device=x.device).transpose(1, 2)
    hb = min(8, triton.next_power_of_2(Hh))
    _rope_kernel[(B * T, triton.cdiv(Hh, hb))](
        x, cos, sin, y, T, Hh,
        x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0), cos.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        BACKWARD=backward, HALF=D // 2, HB=hb, num_warps=4,
        enable_fp_fusion=False)                      # no FMA: each product rounded (HF's numerics)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_launch(dy, cos, sin, True), None, None


def rope(x, cos, sin):
    """apply_rope in one launch per tensor, forward and backward (Triton on CUDA and under
    TRITON_INTERPRET=1): x (B, heads, T, D) any strides with unit stride in D, cos / sin (B, 1, T,
    D); for the training forward."""
    half = x.shape[-1] // 2
    if not (_use_triton(x) and half & (half - 1) == 0 and x.stride(-1) == 1
            and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and x.dtype == cos.dtype and not cos.requires_grad):
        return apply_rope(x, cos, sin)
    return _Rope.apply(x, cos, sin)


def rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots):
    """q, k, v (B, T, heads, D); cos, sin (B, T, D); cache_k/v (B, kv_heads, S, D); slots (T,).
    Writes the rotated k and v to the cache at `slots`; returns the rotated q as (B, heads, T,
    D)."""
    def rot(x):
        return apply_rope(x, cos[:, :, None], sin[:, :, None])
    cache_k.index_copy_(2, slots, rot(k).transpose(1, 2))
    cache_v.index_copy_(2, slots, v.transpose(1, 2))
    return rot(q).transpose(1, 2)


if triton is not None:
    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ck_ptr, cv_ptr, slot_ptr,
                           T, HQ, HK, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, scb, sct,
                           sob, soh, sot, scacheb, scacheh, scaches, HALF: tl.constexpr):
        bt, h = tl.program_id(0), tl.program_id(1)           # one (token, head) vector per program
        b, t = (bt // T).to(tl.int64), bt % T
        i = tl.arange(0, HALF)
        dt = qo_ptr.dtype.element_ty
        if h < HQ + HK:                                       # q or k: rotate
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
            o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, dt, False)
            tl.store(dst + i, o1.to(dt))
            tl.store(dst + HALF + i, o2.to(dt))
        else:                                                 # v: copied into the cache
            src = v_ptr + b * svb + t * svt + (h - HQ - HK) * svh
            dst = cv_ptr + b * scacheb + (h - HQ - HK) * scacheh + tl.load(slot_ptr + t) * scaches
            tl.store(dst + i, tl.load(src + i))
            tl.store(dst + HALF + i, tl.load(src + HALF + i))


def rope_cache(q, k, v, cos, sin, cache_k, cache_v, slots):
    """rope_cache_ref in one launch (Triton on CUDA and under TRITON_INTERPRET=1), for generation
    only: no autograd."""
    D = q.shape[-1]
    half = D // 2
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    unit = all(t.stride(-1) == 1 for t in (q, k, v, cos, sin, cache_k))
    usable = (_use_triton(q) and not grads and half & (half - 1) == 0 and unit
              and cache_k.stride() == cache_v.stride() and cos.stride() == sin.stride()
              and q.dtype == cos.dtype)
    if not usable:
        return rope_cache_ref(q, k, v, cos, sin, cache_k, cache_v, slots)
    B, T, HQ, _ = q.shape
    HK = k.shape[2]
    qo = torch.empty(B, HQ, T, D, dtype=q.dtype, device=q.device)
    _rope_cache_kernel[(B * T, HQ + 2 * HK)](
        q, k, v, cos, sin, qo, cache_k, cache_v, slots, T, HQ, HK,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *cos.stride()[:2], *qo.stride()[:3],
        *cache_k.stride()[:3], HALF=half, num_warps=1, enable_fp_fusion=False)
    return qo


# --------------------------------------------------------------------------------------------------
# SiLU(gate) * up in one pass (the MLP between gate_up and down), rounded like torch's two ops

def silu_mul_ref(gu, n: int, up_off: int):
    """Reference: silu(gate) * up for gu (..., W) holding gate in columns [0, n) and up in [up_off,
    up_off + n)."""
    return torch.nn.functional.silu(gu[..., :n]) * gu[..., up_off:up_off + n]


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(gu_ptr, dy_ptr, y_ptr, N, UP, stride_gu,
                         BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        dt = y_ptr.dtype.element_ty
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + UP + cols, mask=m, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        # silu, rounded as torch does
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        if BACKWARD:
            # y (rows, W) receives d gate and d up at the columns of gate and up, rounded like
            # torch's ops
            dy = tl.load(dy_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
            ds = (dy * u).to(dt).to(tl.float32)
            dg = ds * sig * (1.0 + g * (1.0 - sig))
            tl.store(y_ptr + row * stride_gu + cols, dg.to(dt), mask=m)
            tl.store(y_ptr + row * stride_gu + UP + cols, (dy * s).to(dt), mask=m)
        else:
            tl.store(y_ptr + row * N + cols, (s * u).to(dt), mask=m)


def _silu_mul_launch(gu2, n, up_off, dy2=None):
    rows, W = gu2.shape
    if dy2 is None:
        y = torch.empty(rows, n, dtype=gu2.dtype, device=gu2.device)
    elif W == 2 * n and up_off == n:
        y = torch.empty_like(gu2)
    else:
        y = torch.zeros_like(gu2)                                     # padding columns: 0
    _silu_mul_kernel[(rows, triton.cdiv(n, 1024))](
        gu2, dy2 if dy2 is not None else gu2, y, n, up_off, gu2.stride(0),
        BACKWARD=dy2 is not None, BLOCK=1024)
    return y


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu2, n, up_off):
        ctx.save_for_backward(gu2)
        ctx.n, ctx.up_off = n, up_off
        return _silu_mul_launch(gu2, n, up_off)

    @staticmethod
    def backward(ctx, dy):
        (gu2,) = ctx.saved_tensors
        return _silu_mul_launch(gu2, ctx.n, ctx.up_off, dy.contiguous()), None, None


def silu_mul(gu, n: int, up_off: int):
    """silu(gate) * up (..., n) from the fused gate_up output gu (..., W): gate in columns [0, n),
    up in [up_off, up_off + n). One Triton kernel forward and one backward, whose gradient is one
    (..., W) tensor, so autograd makes no per-half zero-filled copies."""
    if not (0 < n <= up_off and up_off + n <= gu.shape[-1]):
        raise ValueError(f"gate [0, {n}) and up [{up_off}, {up_off + n}) must be disjoint "
                         f"columns of gu (width {gu.shape[-1]})")
    if not _use_triton(gu):
        return silu_mul_ref(gu, n, up_off)
    gu2 = gu.reshape(-1, gu.shape[-1])                                             # (rows, W)
    gu2 = gu2 if gu2.stride(-1) == 1 else gu2.contiguous()
    return _SiluMul.apply(gu2, n, up_off).view(*gu.shape[:-1], n)


# --------------------------------------------------------------------------------------------------
# RMSNorm with an AQN noise vector: y = (weight + noise) * bf16(x * rsqrt(mean(x^2) + eps)), HF
# numerics. weight + noise is formed in fp32 and multiplied in fp32, one rounding to the output:
# rounded to bf16 first, w + z would equal w for |w| in [0.5, 2] and sigma <= 7e-4 (half a bf16 ulp
# there is 2e-3 to 4e-3), so the late AQN stages would add nothing.

def rms_norm_ref(x, weight, eps: float, noise=None, residual=None):
    """Reference (differentiable). With residual: h = x + residual (rounded like the HF layers),
    returns (y, h). Without noise y = weight * x_hat as HF computes it; with noise y = (weight +
    noise in fp32) * x_hat rounded once to the dtype HF's product has (torch's promotion of weight
    and x), so a zero noise gives HF's y bit for bit."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    xf = h.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    if noise is None:
        y = weight * xn
    else:
        # (H,) fp32: keeps the small z
        w = weight.float() + noise.float()
        y = (w * xn.float()).to(torch.promote_types(weight.dtype, h.dtype))
    return y if residual is None else (y, h)


if triton is not None:
    @triton.jit
    def _rms_fwd_kernel(x_ptr, r_ptr, w_ptr, z_ptr, y_ptr, h_ptr, rstd_ptr, H, eps,
                        HAS_RES: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + row * H + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + row * H + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_NOISE:
            # weight + noise stays fp32 (rounded to bf16 the late, small noise would vanish)
            w += tl.load(z_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        xn = (xf * rstd).to(x.dtype).to(tl.float32)
        tl.store(y_ptr + row * H + cols, (w * xn).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_bwd_kernel(dy_ptr, dh_ptr, h_ptr, w_ptr, z_ptr, rstd_ptr, dx_ptr, dw_ptr,
                        M, H, ROWS_PER_PROG,
                        HAS_DH: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_NOISE:
            # dX sees the forward's effective weight, weight + noise in fp32; dW needs no noise
            # term,
            w += tl.load(z_ptr + cols, mask=mask, other=0.0).to(tl.float32)   # d(w + z)/dw = 1
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.range(0, ROWS_PER_PROG, num_stages=3):
            # masked, not branched: the loads of later rows go ahead
            row = (pid * ROWS_PER_PROG + i).to(tl.int64)
            rm = mask & (row < M)
            rstd = tl.load(rstd_ptr + row, mask=row < M, other=0.0)
            xhat = tl.load(h_ptr + row * H + cols, mask=rm, other=0.0).to(tl.float32) * rstd
            dy = tl.load(dy_ptr + row * H + cols, mask=rm, other=0.0).to(tl.float32)
            dxhat = dy * w
            dx = (dxhat - xhat * (tl.sum(dxhat * xhat, axis=0) / H)) * rstd
            if HAS_DH:
                dx += tl.load(dh_ptr + row * H + cols, mask=rm, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=rm)
            dw += dy * xhat
        tl.store(dw_ptr + pid * H + cols, dw, mask=mask)


def _rms_config(H: int) -> dict:
    block = triton.next_power_of_2(H)
    return dict(BLOCK=block, num_warps=max(1, min(16, block // 512)))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, noise, residual):
        H = x.shape[-1]
        x2 = x.reshape(-1, H).contiguous()
        r2 = residual.reshape(-1, H).contiguous() if residual is not None else None
        y = torch.empty_like(x2)
        h = torch.empty_like(x2) if r2 is not None else x2
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        z = noise.contiguous() if noise is not None else weight
        _rms_fwd_kernel[(x2.shape[0],)](x2, r2 if r2 is not None else x2, weight, z, y, h, rstd,
                                        H, eps, HAS_RES=r2 is not None,
                                        HAS_NOISE=noise is not None, **_rms_config(H))
        ctx.save_for_backward(h, weight, noise, rstd)
        ctx.has_res = residual is not None
        y = y.reshape(x.shape)
        return (y, h.reshape(x.shape)) if ctx.has_res else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, noise, rstd = ctx.saved_tensors
        H = h.shape[-1]
        M = h.shape[0]
        sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 2
        progs = min(M, 2 * sms)
        per = -(-M // progs)
        dx = torch.empty_like(h)
        dw = torch.empty(progs, H, dtype=torch.float32, device=h.device)
        dh2 = dh.reshape(-1, H).contiguous() if dh is not None else None
        _rms_bwd_kernel[(progs,)](dy.reshape(-1, H).contiguous(),
                                  dh2 if dh2 is not None else dx, h, weight,
                                  noise if noise is not None else weight, rstd, dx, dw, M, H, per,
                                  HAS_DH=dh2 is not None, HAS_NOISE=noise is not None,
                                  **_rms_config(H))
        dx = dx.reshape(dy.shape)
        dweight = dw.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dweight, None, None, (dx if ctx.has_res else None)


def rms_norm(x, weight, eps: float, noise=None, residual=None):
    """Fused (residual add +) RMSNorm whose effective weight is weight + noise. Returns y, or (y, x
    + residual).

    Triton on CUDA (and under TRITON_INTERPRET=1), the reference otherwise; both are differentiable
    (dX, dW).
    """
    H = x.shape[-1]
    if weight.shape != (H,) or (noise is not None and noise.shape != (H,)):
        raise ValueError(f"weight and noise must have shape ({H},), got {tuple(weight.shape)}"
                         f"{'' if noise is None else ' and ' + str(tuple(noise.shape))}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    if not _use_triton(x):
        return rms_norm_ref(x, weight, eps, noise, residual)
    return _RMSNorm.apply(x, weight, eps, noise, residual)
