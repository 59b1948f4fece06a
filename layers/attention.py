"""attention.py: decode attention over the KV cache (one new token per sequence), a Triton kernel
beside its reference.

    pytest tests/test_attention.py
        # the kernel against the reference (CPU: TRITON_INTERPRET=1)
    python -m bench kernels --parts attn
        # H100: the kernel against torch SDPA at the rollout's sizes
    python -m bench profile --ab attn --batches 1,16,64
        # H100: the engine's decode step with it and with SDPA

A decode step's attention reads every key and value of every sequence once (2 * B * kv_heads * kv *
head_dim bf16) and little else: a streaming kernel. A program takes one KV head of one sequence,
with all the query heads of its GQA group as the rows of one tile (padded to 16 for the tensor
cores), and one chunk of the keys; where a sequence has several chunks (few sequences: more programs
to fill the SMs), a second launch merges their softmax partials (flash-decoding). The mask is the
engine's bool (B, S) of valid keys, read as it is. In a decode step the kernel also applies RoPE to
q and the new key and writes the new key and value to the cache (the program whose chunk holds their
slot; it counts them from registers), so ops.rope_cache needs no launch of its own. Used by model.py
for decode steps (one new token a row, with a cache); the prefill and training keep torch SDPA. With
a_next (NANOQERL_LORA_ATTN=1) the merge launch also makes o_proj's LoRA A product of the output, so
that product takes no launch of its own. Leaves out: sliding windows, soft-capping, ALiBi; head_dim
that is not a power of two and fp32 fall back to the reference.
"""
import math

import torch

from gemm.layout import workspace
from kernels import INTERPRET, _use_triton, triton
from layers.ops import rope_cache
from layers.shrink import lora_shrink

if triton is not None:
    import triton.language as tl

    from layers.ops import _rotate


def decode_attention_ref(q, k, v, valid, scale: float):
    """q (B, HQ, 1, D); k, v (B, HK, S, D) (HQ a multiple of HK); valid (B, S) bool
    -> (B, HQ, 1, D).
    Softmax over the valid keys in fp32, as SDPA's math path computes it, cast to q's dtype at the
    end."""
    B, HQ, _, D = q.shape
    G = HQ // k.shape[1]
    kf, vf = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)  # (B, HQ, S, D)
    s = (q.float() @ kf.transpose(-1, -2)) * scale                                 # (B, HQ, 1, S)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return (torch.softmax(s, -1) @ vf).to(q.dtype)


if triton is not None:
    @triton.jit
    def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, o_ptr, part_ptr, ml_ptr,
                            S, CHUNK, HK, G, qk_scale,
                            sqb, sqh, skb, skh, sks, svb, svh, svs, sval, sob, soh,
                            kn_ptr, vn_ptr, cos_ptr, sin_ptr, slot_ptr,
                            sknb, sknh, svnb, svnh, scb,
                            D: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr,
                            SPLIT: tl.constexpr, F32: tl.constexpr, ROPE: tl.constexpr = False):
        bh, c = tl.program_id(0), tl.program_id(1)        # (sequence, KV head), chunk of the keys
        b, hk = (bh // HK).to(tl.int64), bh % HK
        g, d = tl.arange(0, GP), tl.arange(0, D)
        hq = hk * G + g                                   # (GP,) the GQA group's query heads
        kb, vb = k_ptr + b * skb + hk * skh, v_ptr + b * svb + hk * svh
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, S)
        if ROPE:  # q and the new key arrive unrotated: rotate them here (ops.rope_cache's
            # numerics), count the new key and value from registers (the loop stops before their
            # slot) and write them to the cache after it
            dt = q_ptr.dtype.element_ty
            e = tl.arange(0, D // 2)
            cp, sp = cos_ptr + b * scb + e, sin_ptr + b * scb + e
            c1, c2 = tl.load(cp).to(tl.float32), tl.load(cp + D // 2).to(tl.float32)  # (D/2,)
            s1, s2 = tl.load(sp).to(tl.float32), tl.load(sp + D // 2).to(tl.float32)
            qp = q_ptr + b * sqb + hq[:, None] * sqh + e[None, :]
            q1 = tl.load(qp, mask=(g < G)[:, None], other=0.0).to(tl.float32)         # (GP, D/2)
            q2 = tl.load(qp + D // 2, mask=(g < G)[:, None], other=0.0).to(tl.float32)
            q1, q2 = _rotate(q1, q2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], dt, False)
            q = tl.reshape(tl.permute(tl.join(q1.to(dt), q2.to(dt)), (0, 2, 1)), (GP, D))  # (GP, D)
            slot = tl.load(slot_ptr)
            # this chunk holds the new slot: one program per (b, hk)
            own = (slot >= lo) & (slot < hi)
            # the new key and value: read by that program alone
            kp = kn_ptr + b * sknb + hk * sknh + e
            k1, k2 = _rotate(tl.load(kp, mask=own, other=0.0).to(tl.float32),
                             tl.load(kp + D // 2, mask=own, other=0.0).to(tl.float32),
                             c1, c2, s1, s2, dt, False)
            vn = tl.load(vn_ptr + b * svnb + hk * svnh + d, mask=own, other=0.0)      # (D,)
            # the loop reads the keys before the slot: causal, and the new one is here
            hi = tl.minimum(hi, slot)
            if own:
                kn = tl.reshape(tl.permute(tl.join(k1.to(dt), k2.to(dt)), (1, 0)),
                                (D,)).to(tl.float32)
                if tl.load(valid_ptr + b * sval + slot) != 0:
                    m_i = tl.sum(q.to(tl.float32) * kn[None, :], 1) * qk_scale        # (GP,)
                    l_i += 1.0
                    acc += vn.to(tl.float32)[None, :]
        else:
            q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + d[None, :],
                        mask=(g < G)[:, None], other=0.0)                             # (GP, D)
        for n0 in tl.range(lo, hi, BN):
            n = n0 + tl.arange(0, BN)                                        # (BN,)
            ok = (n < hi) & (tl.load(valid_ptr + b * sval + n, mask=n < hi, other=0) != 0)
            kt = tl.load(kb + n[:, None] * sks + d[None, :],
                         mask=(n < hi)[:, None], other=0.0)                 # (BN, D)
            vt = tl.load(vb + n[:, None] * svs + d[None, :],
                         mask=(n < hi)[:, None], other=0.0)                 # (BN, D)
            # the interpreter multiplies bf16 dot operands wrongly; fp32 of bf16 values is exact
            if F32:
                s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32))) * qk_scale
            else:
                s = tl.dot(q, tl.trans(kt)) * qk_scale                       # (GP, BN), log2 units
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)             # no valid key yet
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])                                  # (GP, BN)
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = (tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32)) if F32
                  else tl.dot(p.to(vt.dtype), vt))
            acc = acc * alpha[:, None] + pv                                  # (GP, D)
            m_i = m_new
        # the new key and value go to the cache after the loop, whose loads need not wait for them
        if ROPE:
            if own:
                tl.store(kb + slot * sks + e, k1.to(dt))
                tl.store(kb + slot * sks + D // 2 + e, k2.to(dt))
                tl.store(vb + slot * svs + d, vn)
        row = b * HK * G + hq                                                # (GP,) row of (B * HQ)
        if SPLIT == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_ptr + b * sob + hq[:, None] * soh + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])
        else:  # park the chunk's unnormalized partial, its max and its sum
            nc = tl.num_programs(1)
            tl.store(part_ptr + (row[:, None] * nc + c) * D + d[None, :], acc,
                     mask=(g < G)[:, None])
            tl.store(ml_ptr + (row * nc + c) * 2, m_i, mask=g < G)
            tl.store(ml_ptr + (row * nc + c) * 2 + 1, l_i, mask=g < G)

    @triton.jit
    def _decode_merge_kernel(part_ptr, ml_ptr, o_ptr, HQ, NC, sob, soh,
                             a_ptr, xa_ptr, xws_ptr, xcnt_ptr, R,
                             D: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr = 0,
                             HQP: tl.constexpr = 1):
        r = tl.program_id(0).to(tl.int64)  # one (sequence, query head) row a program
        c, d = tl.arange(0, CP), tl.arange(0, D)
        m = tl.load(ml_ptr + (r * NC + c) * 2, mask=c < NC, other=float("-inf"))           # (CP,)
        lsum = tl.load(ml_ptr + (r * NC + c) * 2 + 1, mask=c < NC, other=0.0)
        mx = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0,
                     tl.exp2(m - tl.where(mx == float("-inf"), 0.0, mx)))                  # (CP,)
        part = tl.load(part_ptr + (r * NC + c[:, None]) * D + d[None, :],
                       mask=(c < NC)[:, None], other=0.0)
        den = tl.sum(w * lsum, 0)
        out = tl.sum(part * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)                # (D,)
        dt = o_ptr.dtype.element_ty
        tl.store(o_ptr + (r // HQ) * sob + (r % HQ) * soh + d, out.to(dt))
        if RP > 0:  # o_proj's A product of the sequence: xa = o (HQ * D) @ A^T (R, HQ * D)^T
            b, h, rr = r // HQ, r % HQ, tl.arange(0, RP)
            # this head's D columns of A, times the output as stored (rounded to its dtype)
            a = tl.load(a_ptr + rr[:, None] * (HQ * D) + h * D + d[None, :],
                        mask=(rr < R)[:, None], other=0.0).to(tl.float32)                  # (RP, D)
            tl.store(xws_ptr + r * RP + rr, tl.sum(a * out.to(dt).to(tl.float32)[None, :], 1))
            tl.debug_barrier()
            # the sequence's last head to finish adds all its heads' partials, in head order
            if tl.atomic_add(xcnt_ptr + b, 1, sem="acq_rel") == HQ - 1:
                hh = tl.arange(0, HQP)
                parts = tl.load(xws_ptr + (b * HQ + hh[:, None]) * RP + rr[None, :],
                                mask=(hh < HQ)[:, None], other=0.0,
                                cache_modifier=".cg")                                    # (HQP, RP)
                tl.store(xa_ptr + b * R + rr, tl.sum(parts, 0).to(dt), mask=rr < R)
                tl.atomic_xchg(xcnt_ptr + b, 0, sem="relaxed")         # ready for the next launch


# decode_attention's cap: the merge holds a row's partials in one warp's registers (32 x 128 fp32)
MAX_CHUNKS = 32


def config_for(programs: int, S: int, sms: int = 132) -> dict:
    """chunks (of the keys, per (sequence, KV head)), block (keys a loop step), warps and stages for
    `programs` (sequence, KV head) pairs over S keys, from `python -m bench kernels --parts attn`
    (7B heads, kv 256-768): one chunk of 128-key steps on 4 warps once the pairs fill the SMs
    (batch 64, kv 768: 38.9 us, 40.1 with 8 warps, 42.0 for two chunks of 64-key steps; as decode
    steps call it, RoPE and the keys bounded by the new slot, 8 warps made the 7B step's attention
    at batch 64 0.86 ms against 0.65, `python -m bench profile --batches 64`); below that, chunks
    for about four programs an SM, of 32- or 64-key steps (batch 1: 24 chunks of 32-key steps,
    5.4 us; batch 16: 9 of 64, 14.5 us)."""
    if programs >= sms:
        return dict(chunks=1, block=128, warps=4, stages=2)
    block = 32 if programs < 32 else 64
    return dict(chunks=max(1, min(-(-4 * sms // programs), -(-S // block))), block=block,
                warps=4, stages=2)


def usable(x, head_dim: int) -> bool:
    """Whether decode_attention runs the kernel for queries on x's device and of x's dtype (else the
    reference): Triton (CUDA, or CPU under TRITON_INTERPRET=1 with kernels.CPU_TRITON), bf16 / fp16,
    head_dim a power of two >= 16, no autograd. model.py asks once per forward, so that the fallback
    keeps SDPA's additive mask."""
    return (_use_triton(x) and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and x.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled())


def rope_fusable(q, new) -> bool:
    """Whether decode_attention(new=...) rotates and writes the new key in its kernel (else
    ops.rope_cache first)."""
    kn, vn, cos, sin, slots = new
    return (slots.numel() == 1 and cos.stride() == sin.stride() and cos.dtype == q.dtype
            and all(t.stride(-1) == 1 for t in (kn, vn, cos)))


def decode_attention(q, k, v, valid, scale: float, config: dict | None = None, new=None,
                     a_next=None):
    """decode_attention_ref with the Triton kernel (CUDA, and CPU under TRITON_INTERPRET=1), else
    the reference.
    config: dict(chunks=key chunks per (sequence, KV head) (more than one adds a merge launch),
    block=keys a loop step (a power of two >= 16), warps, stages (pipeline depth)); default
    config_for's.
    new=(k_new (B, HK, D), v_new, cos (B, D), sin, slots (1,)): a decode step's new key and value,
    q and k_new not rotated yet, k and v views of the caches: RoPE on q and k_new, k_new and v_new
    written to the caches at slots, then attention, in the one kernel (as ops.rope_cache followed by
    the attention; that where it cannot). The new token attends to no key after its slot (causal),
    so the kernel reads the keys up to the slot only.
    a_next=A (R, HQ * D), R <= 128: also o_proj's LoRA A product of the output, xa = o @ A^T (B, R)
    in q's dtype; returns (o, xa). Where the merge launch runs (several chunks: fewer (sequence, KV
    head) pairs than SMs), that launch makes it: each head's program its partial, the sequence's
    last one their sum in head order; else layers/shrink.lora_shrink after."""
    B, HQ, T, D = q.shape
    HK, S = k.shape[1], k.shape[2]
    if T != 1 or HQ % HK or valid.shape != (B, S):
        raise ValueError("decode attention takes q (B, HQ, 1, D), k/v (B, HK, S, D), "
                         f"valid (B, S); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(valid.shape)}")
    ok = (usable(q, D) and k.dtype == v.dtype == q.dtype and valid.dtype == torch.bool
          and HQ // HK <= 64 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1)
    if new is not None and not (ok and rope_fusable(q, new)):
        kn, vn, cos, sin, slots = new
        q = rope_cache(q.transpose(1, 2), kn[:, None], vn[:, None], cos[:, None], sin[:, None],
                       k, v, slots)
        valid, new = valid & (torch.arange(S, device=valid.device) <= slots[-1]), None
    if not ok:
        o = decode_attention_ref(q, k, v, valid, scale)
        return o if a_next is None else (o, a_product(o, a_next))
    G = HQ // HK
    cfg = {**config_for(B * HK, S), **(config or {})}
    block = cfg["block"]
    nc = max(1, min(cfg["chunks"], MAX_CHUNKS))
    chunk = -(-S // nc // block) * block  # keys per chunk, a multiple of the block
    nc = -(-S // chunk)
    o = torch.empty(B, HQ, 1, D, dtype=q.dtype, device=q.device)
    part = torch.empty(B * HQ * nc * D if nc > 1 else 1, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * HQ * nc * 2 if nc > 1 else 1, dtype=torch.float32, device=q.device)
    vb = valid.view(torch.uint8)
    rope = new if new is not None else (q, q, q, q, valid)   # (unused without new)
    _decode_attn_kernel[(B * HK, nc)](
        q, k, v, vb, o, part, ml, S, chunk, HK, G, scale * math.log2(math.e),
        q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3], vb.stride(0),
        o.stride(0), o.stride(1), *rope,
        *((rope[0].stride(0), rope[0].stride(1), rope[1].stride(0), rope[1].stride(1),
           rope[2].stride(0))
          if new is not None else (0,) * 5),
        D=D, GP=max(16, triton.next_power_of_2(G)), BN=block, SPLIT=1 if nc == 1 else 2,
        F32=INTERPRET, ROPE=new is not None, num_warps=cfg["warps"], num_stages=cfg["stages"],
        enable_fp_fusion=new is None)
    fused = a_next is not None and nc > 1 and a_next.shape[0] <= 128
    if nc > 1:
        R = a_next.shape[0] if fused else 0
        RP = max(16, triton.next_power_of_2(R)) if fused else 0
        xa = torch.empty(B, R, dtype=q.dtype, device=q.device) if fused else o
        a = a_next.to(q.dtype).contiguous() if fused else o
        # each head's partial (fp32) and a counter per sequence (reset by its last program)
        xws, xcnt = workspace(q.device, B * HQ * RP, B) if fused else (o, o)
        _decode_merge_kernel[(B * HQ,)](part, ml, o, HQ, nc, o.stride(0), o.stride(1),
                                        a, xa, xws, xcnt, R, D=D,
                                        CP=max(2, triton.next_power_of_2(nc)), RP=RP,
                                        HQP=triton.next_power_of_2(HQ) if fused else 1,
                                        num_warps=1)
    if a_next is None:
        return o
    return o, xa if fused else a_product(o, a_next)


def a_product(o, A):
    """o (B, HQ, 1, D) @ A (R, HQ * D)^T -> (B, R) in o's dtype (layers/shrink.lora_shrink)."""
    return lora_shrink(o.reshape(o.shape[0], -1), A.to(o.dtype))
