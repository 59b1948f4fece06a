"""layers/attention.py: the decode attention kernel against its reference, and model.py's decode
step running it.

On CPU the kernel runs under TRITON_INTERPRET=1; on a CUDA machine the real kernel, plus the 7B /
32B head shapes."""
import pytest
import torch

from layers import attention as A
import kernels as K
import model as M

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(K, "CPU_TRITON", True)


def tolerance(v, device):
    """The kernel rounds the softmax weights to bf16 before they multiply V (as flash attention
    does) and the output to bf16: each a relative 2^-9 on the GPU (round to nearest), 2^-8 under the
    interpreter (it truncates), so the output is within two such roundings of max |v| of the fp32
    reference, plus fp32 summation order."""
    return 2 * (2.0 ** -9 if device == "cuda" else 2.0 ** -8) * v.float().abs().max().item() + 1e-4


CASES = [  # B, HQ, HK, S (keys read), D, chunks (None: config_for's choice), keys a loop step
    (1, 1, 1, 16, 16, 1, 64),
    (2, 7, 1, 70, 32, None, 64),
    (1, 4, 2, 130, 16, 3, 64),
    (3, 14, 2, 64, 64, 1, 64),
    (2, 5, 5, 200, 32, 4, 64),
    (2, 12, 2, 1, 16, None, 64),
    (2, 7, 1, 200, 32, 1, 16),
    (1, 4, 2, 150, 16, 2, 32),
    (33, 8, 4, 40, 16, None, 64),
    (1, 4, 2, 2500, 16, None, 64),
    (1, 2, 1, 300, 16, 99, 16)]


@pytest.mark.parametrize("B,HQ,HK,S,D,chunks,block", CASES + (
    [(4, 28, 4, 768, 128, None, 64),
     (2, 40, 8, 520, 128, None, 64),
     (64, 28, 4, 700, 128, None, 64),
     (64, 28, 4, 700, 128, 3, 32)] if CUDA else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_matches_reference(B, HQ, HK, S, D, chunks, block, dtype):
    """GQA groups of 1-14 query heads, config_for's choices (several chunks, or one of 128-key steps
    on 8 warps where the (sequence, KV head) pairs fill the SMs) and others: one chunk or several
    (the merge launch), chunks of one block or several (the online softmax rescales), keys read from
    a longer cache (a strided slice, as the engine reads it), padding in the mask, and a chunk whose
    keys are all masked."""
    g = torch.Generator().manual_seed(S * 7 + HQ)
    q = torch.randn(B, HQ, 1, D, generator=g).to(DEV, dtype)
    cache = torch.randn(2, B, HK, S + 9, D, generator=g).to(DEV, dtype)
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]
    valid = torch.rand(B, S, generator=g).to(DEV) > 0.25
    valid[0, : min(S - 1, 80)] = False  # no valid key in the first chunk(s) of row 0
    valid[:, -1] = True                 # the new token's own slot
    with torch.no_grad():
        cfg = None if chunks is None else dict(chunks=chunks, block=block, warps=4, stages=2)
        out = A.decode_attention(q, k, v, valid, D ** -0.5, cfg)
    ref = A.decode_attention_ref(q, k, v, valid, D ** -0.5)
    assert out.shape == ref.shape and out.dtype == dtype and torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    print(f"decode attention {DEV} {dtype} B={B} HQ={HQ} HK={HK} S={S} D={D}: "
          f"max |kernel - reference| {err:.3g}")
    assert err <= tolerance(v, DEV)
    # the reference is attention as SDPA defines it
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=valid[:, None, None], scale=D ** -0.5,
        enable_gqa=True)
    assert (sdpa - ref.float()).abs().max().item() <= 2.0 ** -8 * v.float().abs().max().item()


@pytest.mark.parametrize("B,HQ,HK,S,D,chunks,slot,slot_valid", [
    (1, 4, 2, 70, 16, 3, 69, True),
    (2, 7, 1, 130, 32, None, 64, True),
    (3, 8, 4, 40, 16, 1, 39, True),
    (2, 4, 2, 100, 16, 4, 50, False),
] + ([(16, 28, 4, 600, 128, None, 599, True)] if CUDA else []))
def test_decode_attention_with_rope_and_cache_write(B, HQ, HK, S, D, chunks, slot, slot_valid):
    """new=(k_new, v_new, cos, sin, slots): the kernel rotates q and the new key, writes the new key
    and value to the cache views (the same bits as ops.rope_cache) and counts them from registers;
    the output matches rope_cache followed by the attention over the keys up to the slot (causal:
    valid keys after it are left out). Slots in the last chunk and inside the chunks, and a new slot
    masked out."""
    from layers import ops
    g = torch.Generator().manual_seed(S + HQ)
    q = torch.randn(B, HQ, 1, D, generator=g).to(DEV, torch.bfloat16)
    kn, vn = torch.randn(2, B, HK, D, generator=g).to(DEV, torch.bfloat16)
    pos = torch.randint(0, 4000, (B, 1), generator=g).to(DEV)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    cos, sin = ops.rope_cos_sin(inv, pos, torch.bfloat16)                     # (B, 1, 1, D)
    cache = torch.randn(2, B, HK, S + 5, D, generator=g).to(DEV, torch.bfloat16)
    two, ref = cache.clone(), cache.clone()
    valid = torch.rand(B, S, generator=g).to(DEV) > 0.25
    valid[:, slot] = slot_valid
    slots = torch.tensor([slot], device=DEV)
    cfg = None if chunks is None else dict(chunks=chunks, block=16, warps=4, stages=2)
    with torch.no_grad():
        assert A.rope_fusable(q, (kn, vn, cos[:, 0, 0], sin[:, 0, 0], slots))
        out = A.decode_attention(q, cache[0, :, :, :S], cache[1, :, :, :S], valid, D ** -0.5, cfg,
                                 new=(kn, vn, cos[:, 0, 0], sin[:, 0, 0], slots))
        qr = ops.rope_cache(q.transpose(1, 2), kn[:, None], vn[:, None], cos[:, 0], sin[:, 0],
                            two[0], two[1], slots)
        causal = valid & (torch.arange(S, device=DEV) <= slot)  # the new token sees no later key
        want = A.decode_attention(qr, two[0, :, :, :S], two[1, :, :, :S], causal, D ** -0.5, cfg)
        if slot < S - 1:  # valid keys after the slot are really left out
            everything = A.decode_attention(qr, two[0, :, :, :S], two[1, :, :, :S], valid,
                                            D ** -0.5)
            assert not torch.allclose(everything, want)
    assert torch.equal(cache, two)                                            # the same cache write
    if CUDA:  # the rotation rounds each product as torch's ops do (no FMA): the reference's bits
        ops.rope_cache_ref(q.transpose(1, 2), kn[:, None], vn[:, None], cos[:, 0], sin[:, 0],
                           ref[0], ref[1], slots)
        assert torch.equal(cache, ref)
    err = (out.float() - want.float()).abs().max().item()
    print(f"decode attention + RoPE {DEV} B={B} HQ={HQ} S={S} slot={slot}: "
          f"max |fused - separate| {err:.3g}")
    assert err <= tolerance(cache[1], DEV)


@pytest.mark.parametrize("B,HQ,HK,S,D,chunks,R", [
    (1, 4, 2, 130, 16, 3, 8),      # the merge launch makes it
    (3, 7, 1, 70, 32, 2, 20),      # R not a power of two, several sequences
    (2, 4, 2, 40, 16, 1, 8),       # one chunk: no merge launch, lora_shrink after
] + ([(1, 28, 4, 700, 128, None, 32), (16, 28, 4, 600, 128, None, 32),
      (64, 28, 4, 600, 128, None, 32)] if CUDA else []))
def test_decode_attention_makes_o_projs_a_product(B, HQ, HK, S, D, chunks, R, monkeypatch):
    """a_next=A: the output is the same as without it, bit for bit, and xa is o @ A^T of that output
    (the reference: layers/shrink.lora_shrink_ref) up to fp32 summation order and one rounding to
    bf16; the merge launch makes it where it runs (several chunks)."""
    from layers.shrink import lora_shrink_ref

    g = torch.Generator().manual_seed(S + R)
    q = torch.randn(B, HQ, 1, D, generator=g).to(DEV, torch.bfloat16)
    kv = torch.randn(2, B, HK, S, D, generator=g).to(DEV, torch.bfloat16)
    valid = torch.rand(B, S, generator=g).to(DEV) > 0.2
    valid[:, -1] = True
    a = (torch.randn(R, HQ * D, generator=g) * 0.05).to(DEV, torch.bfloat16)
    cfg = None if chunks is None else dict(chunks=chunks, block=32, warps=4, stages=2)
    after = []  # calls of the separate A product (one chunk: no merge launch to make it)
    real = A.a_product
    monkeypatch.setattr(A, "a_product", lambda *x: after.append(1) or real(*x))
    with torch.no_grad():
        plain = A.decode_attention(q, kv[0], kv[1], valid, D ** -0.5, cfg)
        o, xa = A.decode_attention(q, kv[0], kv[1], valid, D ** -0.5, cfg, a_next=a)
    assert torch.equal(o, plain)
    if chunks is not None:
        assert len(after) == (chunks == 1)
    want = lora_shrink_ref(o.reshape(B, -1), a)                                   # (B, R)
    assert xa.shape == (B, R) and xa.dtype == torch.bfloat16
    err = (xa.float() - want.float()).abs().max().item()
    print(f"o_proj A product in the attention {DEV} B={B} HQ={HQ} R={R}: "
          f"max |fused - ref| {err:.3g}")
    # one bf16 rounding apart at most (the fp32 sums differ in order only)
    assert err <= 2.0 ** -7 * want.float().abs().max().item() + 1e-3
    # a second call: the per-sequence counters were left at zero for it
    with torch.no_grad():
        _, again = A.decode_attention(q, kv[0], kv[1], valid, D ** -0.5, cfg, a_next=a)
    assert torch.equal(again, xa)


def test_decode_attention_input_checks_and_fallback():
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    valid = torch.ones(1, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="q \\(B, HQ, 1, D\\)"):
        A.decode_attention(q, k, k, valid, 0.25)                      # two query tokens
    with pytest.raises(ValueError, match="valid \\(B, S\\)"):
        A.decode_attention(q[:, :, :1], k, k, valid[:, :4], 0.25)
    q3 = torch.randn(1, 4, 1, 24, dtype=torch.bfloat16, device=DEV)
    k3 = torch.randn(1, 2, 8, 24, device=DEV).bfloat16()
    valid = valid.to(DEV)
    assert A.usable(q3, 32) is False                                   # autograd on: the reference
    with torch.no_grad():
        assert not A.usable(q3, 24) and A.usable(q3, 32)               # head_dim 24: the reference
    assert torch.equal(A.decode_attention(q3, k3, k3, valid, 0.2),
                       A.decode_attention_ref(q3, k3, k3, valid, 0.2))


def test_model_decode_step_runs_the_kernel(make_checkpoint, monkeypatch):
    """A bf16 model decoding with a KV cache: every layer's attention goes through the kernel, and
    the logits match the same steps with torch SDPA (the kernel off) to bf16 rounding."""
    m = M.Model.from_pretrained(make_checkpoint("qwen2"), DEV, torch.bfloat16)
    calls = []
    real, real_usable = A.decode_attention, A.usable
    monkeypatch.setattr(A, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def decode(kernel_on):
        monkeypatch.setattr(A, "usable", real_usable if kernel_on else lambda *a, **kw: False)
        ids = torch.tensor([[3838, 374, 220, 17, 10, 18]], device=DEV)
        cache = M.KVCache(m.cfg, 1, 16, DEV)
        valid = torch.zeros(1, 16, dtype=torch.bool, device=DEV)
        valid[:, :6] = True
        slots = torch.arange(6, device=DEV)
        outs = []
        with torch.no_grad():
            h = m(ids, slots[None], M.attention_mask(valid[:, :6], valid[:, :6], slots), cache,
                  slots, 6)
            tok = m.logits(h[:, -1]).argmax(-1)
            for t in range(6, 10):
                valid[:, t] = True
                h = m(tok[:, None], torch.tensor([[t]], device=DEV), valid[:, None, None, :t + 1],
                      cache, torch.tensor([t], device=DEV), t + 1)
                outs.append(m.logits(h[:, 0]).float())
                tok = outs[-1].argmax(-1)
        return torch.stack(outs)

    off = decode(False)
    assert not calls
    on = decode(True)
    assert len(calls) == 4 * m.cfg.num_layers
    err = (on - off).abs().max().item()
    print(f"decode logits, kernel vs SDPA: max |diff| {err:.3g} "
          f"of max |logit| {off.abs().max().item():.3g}")
    assert err <= 0.02 * off.abs().max().item()    # a few bf16 roundings through the layers
