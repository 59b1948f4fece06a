"""sampler.py: the rollout's sampler, a Triton kernel beside its PyTorch reference:
  race_sample(logits, e, T)    a token per row from softmax(logits / T) by the exponential race
                               (argmax of p_i / e_i with e_i ~ Exp(1)), in one read of the logits:
                               chunks of a row, then a merge

    pytest tests/test_kernels.py -k race          # against race_sample_ref

rollout.py draws the noise e (one random stream per sample) and calls race_sample on CUDA.
Leaves out: top-k / top-p inside the kernel (rollout.py masks the logits before it).
"""
import torch

from kernels import _use_triton, triton

if triton is not None:
    import triton.language as tl


def race_sample_ref(logits, e, temperature: float):
    """Reference. logits (B, V), e (B, V) Exp(1) noise -> tokens (B,) int64, logprobs (B,) fp32 with
    z = logits / T: token = argmax_i z_i - log e_i (= argmax p_i / e_i: an exact draw from
    softmax(z); -inf logits never win), logprob = z_token - logsumexp(z)."""
    z = logits.float() * (1.0 / temperature)                                   # (B, V)
    s = torch.where(z == float("-inf"), float("-inf"), z - e.float().log())
    tok = s.argmax(-1)
    return tok, z.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(z, -1)


if triton is not None:
    @triton.jit
    def _race_reduce(m, l, best, arg, NONE):
        # over lanes (or chunks): the max z, the sum of exp(z - max), the best race score and its
        # first index
        mx, top = tl.max(m, 0), tl.max(best, 0)
        lsum = tl.sum(tl.where(m == float("-inf"), 0.0, l * tl.exp(m - mx)), 0)
        return mx, lsum, top, tl.min(tl.where(best == top, arg, NONE), 0)

    @triton.jit
    def _race_part_kernel(z_ptr, e_ptr, part_ptr, V, CH, stride_z, stride_e, inv_t,
                          BLOCK: tl.constexpr):
        # program (row, chunk): per lane a running race winner and an online logsumexp over the
        # chunk's CH logits, reduced across lanes to 4 partials (max z, sum exp(z - max), best race
        # score, its index)
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        NEG: tl.constexpr = float("-inf")
        # running max of z per lane
        m = tl.full((BLOCK,), NEG, tl.float32)
        # sum of exp(z - m) per lane
        l = tl.zeros((BLOCK,), tl.float32)
        # best race score per lane
        best = tl.full((BLOCK,), NEG, tl.float32)
        # its index (first on ties)
        arg = tl.zeros((BLOCK,), tl.int32)
        for v0 in range(c * CH, tl.minimum(c * CH + CH, V), BLOCK):
            i = v0 + offs
            z = tl.load(z_ptr + row * stride_z + i, mask=i < V, other=NEG) * inv_t
            e = tl.load(e_ptr + row * stride_e + i, mask=i < V, other=1.0)
            s = tl.where(z == NEG, NEG, z - tl.log(e))
            arg = tl.where(s > best, i, arg)
            best = tl.maximum(best, s)
            m_new = tl.maximum(m, z)
            l = tl.where(m_new == NEG, 0.0, l * tl.exp(m - m_new) + tl.exp(z - m_new))
            m = m_new
        mx, lsum, top, tok = _race_reduce(m, l, best, arg, V)
        p = part_ptr + (row * tl.num_programs(1) + c) * 4
        tl.store(p, mx)
        tl.store(p + 1, lsum)
        tl.store(p + 2, top)
        tl.store(p + 3, tok.to(tl.float32))                                    # exact: V < 2^24

    @triton.jit
    def _race_merge_kernel(z_ptr, part_ptr, tok_ptr, lp_ptr, C, stride_z, inv_t, BC: tl.constexpr):
        # one row per program: the chunks' partials -> the winner (first index among ties) and its
        # log-probability
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BC)
        NEG: tl.constexpr = float("-inf")
        p = part_ptr + (row * C + c) * 4
        m = tl.load(p, mask=c < C, other=NEG)
        l = tl.load(p + 1, mask=c < C, other=0.0)
        best = tl.load(p + 2, mask=c < C, other=NEG)
        arg = tl.load(p + 3, mask=c < C, other=float(2 ** 24)).to(tl.int32)
        mx, lsum, _, tok = _race_reduce(m, l, best, arg, 2 ** 24)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, tl.load(z_ptr + row * stride_z + tok) * inv_t - (mx + tl.log(lsum)))


def race_sample(logits, e, temperature: float, chunks: int | None = None):
    """Draw one token per row from softmax(logits / T) given Exp(1) noise e (see race_sample_ref);
    Triton on CUDA: one read of logits and noise instead of a log-softmax, an exp, a division, an
    argmax and a gather. Each row is cut into `chunks` pieces (default: enough for about 256
    programs) whose partial results a second launch merges: at batch 1 / 16 / 64, 5.7 / 11.7 / 40.9
    us for 152k logits against 67 / 68 / 109 us with one program a row (`python -m bench kernels
    --parts sampler`, H100)."""
    if logits.shape != e.shape or logits.dim() != 2:
        raise ValueError(f"logits and noise must be (B, V) of one shape, got "
                         f"{tuple(logits.shape)}, {tuple(e.shape)}")
    if not (_use_triton(logits) and logits.dtype == e.dtype == torch.float32
            and logits.stride(-1) == e.stride(-1) == 1
            and logits.shape[1] < 2 ** 24):                 # the partials hold indices as fp32
        return race_sample_ref(logits, e, temperature)
    (B, V), BLOCK = logits.shape, 2048
    C = chunks or max(1, min(256 // B, triton.cdiv(V, BLOCK)))
    # logits per chunk, whole blocks
    CH = triton.cdiv(triton.cdiv(V, C), BLOCK) * BLOCK
    C = triton.cdiv(V, CH)
    part = torch.empty(B, C, 4, dtype=torch.float32, device=logits.device)
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _race_part_kernel[(B, C)](logits, e, part, V, CH, logits.stride(0), e.stride(0),
                              1.0 / temperature, BLOCK=BLOCK, num_warps=8)
    _race_merge_kernel[(B,)](logits, part, tok, lp, C, logits.stride(0), 1.0 / temperature,
                             BC=max(16, triton.next_power_of_2(C)), num_warps=1)
    return tok, lp
