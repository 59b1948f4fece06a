"""rollout.py: the built-in engine against step-by-step decoding with model.py, its logprobs against
the model's log-softmax, stops, lengths, n > 1, mixed prompt lengths, seeding, AQN, and bad input.
CPU (and CUDA if present)."""
import pytest
import torch

import eval as E
import kernels
import lora
import model as M
import noise
import quantize as Q
import rollout as R

PROMPTS = [[3838, 374, 220, 17, 10, 18, 30], [40, 1079, 264],
           [9707, 11, 1879, 0, 576, 4226, 374, 25, 17, 10]]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def models(make_checkpoint, tmp_path_factory):
    src = make_checkpoint("qwen2", dtype=torch.float32)
    q = tmp_path_factory.mktemp("q") / "nvfp4"
    Q.quantize_checkpoint(str(src), str(q), progress=False)
    return {"fp32": M.Model.from_pretrained(src, DEV, torch.float32),
            "nvfp4": M.Model.from_pretrained(q, DEV, torch.float32),
            "bf16": M.Model.from_pretrained(src, DEV, torch.bfloat16)}


def is_greedy(m, prompt, tokens, tol):
    """Every token is the argmax of the model's logits given its prefix (up to `tol`: a batched GEMM
    may round differently from a single-row one, which can flip a near tie)."""
    ids = torch.tensor([prompt + tokens], device=DEV)
    with torch.no_grad():
        z = m.logits(
            m.forward_padded(ids, torch.ones_like(ids, dtype=torch.bool))[0, len(prompt) - 1:-1]
        ).float()
    return bool((z.gather(-1, ids[0, len(prompt):, None])[:, 0] >= z.max(-1).values - tol).all())


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_greedy_equals_step_by_step_argmax(models, kind):
    m = models[kind]
    eng = R.Engine(m, max_batch=8, max_len=64)
    out = eng.generate(PROMPTS, n=2, max_new_tokens=12, temperature=0.0, stop_token_ids=[])
    assert [s.prompt_idx for s in out] == [0, 0, 1, 1, 2, 2]  # group-major
    tol = 1e-3 if kind == "nvfp4" else 0.1  # bf16 logits are rounded to 2^-8 relative
    for s in out:
        assert (len(s.tokens) == 12 and s.finish_reason == "length"
                and is_greedy(m, PROMPTS[s.prompt_idx], s.tokens, tol))
        if DEV == "cpu":  # the same arithmetic as model.greedy: exactly its tokens
            assert s.tokens == M.greedy(m, PROMPTS[s.prompt_idx], 12)


def recompute_logprobs(m, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens], device=DEV)
    with torch.no_grad():
        h = m.forward_padded(ids, torch.ones_like(ids, dtype=torch.bool))[0]
        lp, _ = M.token_logprobs(m, h[len(prompt) - 1:-1], ids[0, len(prompt):], temperature)
    return lp


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_model_log_softmax(models, temperature):
    m = models["nvfp4"]
    out = R.Engine(m, max_batch=4, max_len=64).generate(PROMPTS, n=3, max_new_tokens=10,
                                                        temperature=temperature, seed=1)
    for s in out:
        ref = recompute_logprobs(m, PROMPTS[s.prompt_idx], s.tokens, temperature)
        assert torch.allclose(torch.tensor(s.logprobs), ref.cpu(), atol=1e-4), (s.logprobs, ref)


@pytest.mark.parametrize("race", [True, False])
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_sampler_draws_from_the_distribution_it_reports(temperature, top_k, race):
    """40000 draws from one row of logits, by the exponential race and by the inverse CDF: token
    frequencies match exp(logprob) within 5 standard errors (a biased sampler, e.g. argmax of p * e
    instead of p / e, is off by far more), and every draw's logprob is its token's."""
    logits = (torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], device=DEV)
              .repeat(40000, 1))  # (draws, V)
    gen = torch.Generator(device=DEV).manual_seed(0)
    tok, lp = R.sample_tokens(logits, temperature, 1.0, top_k, gen, race=race)
    z = logits[0] / temperature
    if top_k:
        z = z.masked_fill(z < z.topk(top_k).values[-1], float("-inf"))
    p = torch.softmax(z, -1)                                                   # (V,)
    freq = torch.bincount(tok, minlength=6).float() / tok.numel()
    se = (p * (1 - p) / tok.numel()).sqrt()
    print(f"sampler race={race} T={temperature} top_k={top_k}: "
          f"freq {freq.tolist()} vs p {p.tolist()}")
    assert ((freq - p).abs() <= 5 * se + 1e-9).all()
    assert torch.allclose(lp, p.log()[tok])


def test_top_k_and_top_p_restrict_and_renormalise(models):
    m = models["fp32"]
    eng = R.Engine(m, max_batch=8, max_len=64)
    greedy = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, stop_token_ids=[])
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        out = eng.generate(PROMPTS, max_new_tokens=6, temperature=1.0, stop_token_ids=[], seed=3,
                           **kw)
        assert [s.tokens for s in out] == [s.tokens for s in greedy]
        # a one-token set has probability 1
        assert all(abs(lp) < 1e-6 for s in out for lp in s.logprobs)
    out = eng.generate(PROMPTS, max_new_tokens=6, temperature=1.0, top_k=5, stop_token_ids=[],
                       seed=3)
    # log-probs under the renormalised top-5 distribution are >= those of the full softmax
    for s in out:
        full = recompute_logprobs(m, PROMPTS[s.prompt_idx], s.tokens, 1.0).cpu()
        assert ((torch.tensor(s.logprobs) >= full - 1e-5).all()
                and (torch.tensor(s.logprobs) > full + 1e-4).any())


def test_stop_tokens_lengths_and_compaction(models):
    m = models["fp32"]
    free = R.Engine(m, max_batch=8, max_len=64).generate(PROMPTS, max_new_tokens=10,
                                                         temperature=0.0, stop_token_ids=[])
    # prompt 1 stops by its 4th token; the others may stop elsewhere or run to the limit
    stop = free[1].tokens[3]
    out = R.Engine(m, max_batch=8, max_len=64).generate(PROMPTS, max_new_tokens=10,
                                                        temperature=0.0, stop_token_ids=[stop])
    for f, s in zip(free, out):
        if stop in f.tokens:
            cut = f.tokens.index(stop) + 1
            assert s.tokens == f.tokens[:cut] and s.finish_reason == "stop"
        else:
            assert s.tokens == f.tokens and s.finish_reason == "length" and len(s.tokens) == 10
    assert (out[1].finish_reason == "stop"
            and len(out[1].tokens) == free[1].tokens.index(stop) + 1 <= 4)


def test_seeding_reproduces(models):
    eng = R.Engine(models["nvfp4"], max_batch=16, max_len=64)
    a = eng.generate(PROMPTS, n=4, max_new_tokens=8, seed=11)
    b = eng.generate(PROMPTS, n=4, max_new_tokens=8, seed=11)
    c = eng.generate(PROMPTS, n=4, max_new_tokens=8, seed=12)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert [s.tokens for s in a] != [s.tokens for s in c]
    assert len({tuple(s.tokens) for s in a[:4]}) > 1  # the n samples of one prompt differ


def test_batches_larger_than_max_batch(models):
    eng = R.Engine(models["fp32"], max_batch=2, max_len=64)
    out = eng.generate(PROMPTS, n=2, max_new_tokens=5, temperature=0.0, stop_token_ids=[])
    assert len(out) == 6 and all(s.tokens == M.greedy(models["fp32"], PROMPTS[s.prompt_idx], 5)
                                 for s in out)


def test_aqn_noise_is_per_call_and_lora_is_read_in_place(models):
    m = models["nvfp4"]
    eng = R.Engine(m, max_batch=8, max_len=64)
    clean = eng.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=5)
    z = noise.draw(m, 0.5, torch.Generator().manual_seed(0))
    noisy = eng.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=5, noise=z)
    assert [s.logprobs for s in clean] != [s.logprobs for s in noisy]
    # the noise lives in the call: the next call without it is the clean policy again
    assert ([s.logprobs for s in eng.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=5)]
            == [s.logprobs for s in clean])
    params = lora.add_lora(m, rank=4, alpha=8)
    with torch.no_grad():
        for p in params[1::2]:
            p.normal_(0, 0.5)  # an "optimizer step": the engine sees it without any sync
    adapted = eng.generate(PROMPTS, max_new_tokens=8, temperature=0.0, stop_token_ids=[])
    assert all(s.tokens == M.greedy(m, PROMPTS[s.prompt_idx], 8) for s in adapted)
    with torch.no_grad():
        for p in params[1::2]:
            # another step: the snapshot is refreshed in place (captured graphs keep it)
            p.normal_(0, 0.5)
    again = eng.generate(PROMPTS, max_new_tokens=8, temperature=0.0, stop_token_ids=[])
    assert [s.tokens for s in again] != [s.tokens for s in adapted]
    assert all(s.tokens == M.greedy(m, PROMPTS[s.prompt_idx], 8) for s in again)
    # outside generate the trainer's path is untouched
    assert all(lin.snap is None for _, lin in m.linears())
    with lora.disabled(m):
        base = eng.generate(PROMPTS, max_new_tokens=8, temperature=0.0, stop_token_ids=[])
        assert all(s.tokens == M.greedy(m, PROMPTS[s.prompt_idx], 8) for s in base)
    for lin in [lin for _, lin in m.linears()]:
        lin.lora_A = lin.lora_B = None
    m.lora_config = None


@pytest.mark.parametrize("in_norm,in_attn,fused", [(False, False, False), (True, False, False),
                                                   (True, True, False), (False, False, True)])
def test_lora_in_the_gemm_epilogue_matches_the_trainer_path(make_checkpoint, tmp_path, monkeypatch,
                                                            in_norm, in_attn, fused):
    """bf16 NVFP4 base with LoRA on every linear, Triton kernels on (the interpreter on CPU):
    generation adds the adapter's snapshot in the GEMM epilogue, the trainer's forward adds it with
    torch ops. Greedy tokens must be argmaxes of the trainer's logits (up to near ties) and the
    engine's logprobs equal the trainer's log-softmax. in_norm: the A products of q/k/v and
    gate/up made by the norms before them (NANOQERL_LORA_NORM=1, layers/shrink.rms_norm_lora).
    in_attn: o_proj's made by the decode attention (NANOQERL_LORA_ATTN=1). fused: every A
    product of a decode step made in its GEMM's own launch (NANOQERL_LORA_FUSED=1, gemm/fused_a)."""
    from gemm import fused_a
    from layers import attention, shrink
    monkeypatch.setattr(kernels, "CPU_TRITON", True)
    monkeypatch.setattr(shrink, "NORM", in_norm)
    monkeypatch.setattr(shrink, "ATTN", in_attn)
    monkeypatch.setattr(shrink, "FUSED", fused)
    in_gemm = []  # (rows, gated) of the GEMMs that made their own A product
    real_fused = fused_a.nvfp4_mm_fused_a

    def counted(x, w, A, B, bias=None, gated=0):
        y = real_fused(x, w, A, B, bias, gated)
        if y is not None:
            in_gemm.append((x.shape[0], gated))
        return y
    monkeypatch.setattr(fused_a, "nvfp4_mm_fused_a", counted)
    handed = []  # decode attention calls asked for o_proj's A product
    real_attn = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention",
                        lambda *a, **k: handed.append(k.get("a_next") is not None)
                        or real_attn(*a, **k))
    normed = []
    real_norm = shrink.rms_norm_lora
    monkeypatch.setattr(shrink, "rms_norm_lora",
                        lambda *a: normed.append(a[-1].shape[0]) or real_norm(*a))
    Q.quantize_checkpoint(str(make_checkpoint("qwen2", dtype=torch.float32)), str(tmp_path / "q"),
                          progress=False)
    m = M.Model.from_pretrained(tmp_path / "q", DEV, torch.bfloat16)
    params = lora.add_lora(m, rank=4, alpha=8)
    with torch.no_grad():
        for p in params[1::2]:
            p.normal_(0, 0.5)
    calls = []
    monkeypatch.setattr(
        kernels, "nvfp4_mm",
        lambda *a, **k: (calls.append((k.get("lora") is not None, k.get("gated", 0)))
                         or K_mm(*a, **k)))
    eng = R.Engine(m, max_batch=4, max_len=64)
    out = eng.generate(PROMPTS[:2], max_new_tokens=4, temperature=0.0, stop_token_ids=[])
    # the epilogue path ran, SiLU x up in gate_up's (in the fused launch where that ran)
    assert all(lo for lo, _ in calls) and any(g for _, g in calls + in_gemm)
    # fused: the 4 groups of every layer at each of the 3 decode steps (2 rows) made their own,
    # and the prefill's too
    decode = [r for r, _ in in_gemm if r == 2]
    assert len(decode) == (4 * len(m.model.layers) * 3 if fused else 0)
    assert fused == (len(in_gemm) > len(decode)) and not (fused and calls)
    # with in_norm, both norms of every layer made their group's A product (rank 4: q/k/v 12
    # rows, gate/up 8), at every generated token
    layers = len(m.model.layers)
    assert sorted(set(normed)) == ([8, 12] if in_norm else [])
    assert len(normed) == (2 * layers * 4 if in_norm else 0)
    # with in_attn, every decode step's attention made o_proj's (the 3 steps after the prefill)
    assert handed == [in_attn] * (layers * 3)
    for s in out:
        assert is_greedy(m, PROMPTS[s.prompt_idx], s.tokens, tol=0.1)
        ref = recompute_logprobs(m, PROMPTS[s.prompt_idx], s.tokens, 1.0).cpu()
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=0.05), (s.logprobs, ref)


K_mm = kernels.nvfp4_mm


def test_bad_input(models):
    eng = R.Engine(models["fp32"], max_batch=4, max_len=32)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[1, 2], []], max_new_tokens=8)
    with pytest.raises(ValueError, match="exceeds the context of 32"):
        eng.generate([[1] * 30], max_new_tokens=8)
    with pytest.raises(ValueError, match="n .* must be >= 1"):
        eng.generate([[1, 2]], n=0, max_new_tokens=8)
    with pytest.raises(ValueError, match="unknown stop token ids"):
        eng.generate([[1, 2]], stop_token_ids=[10**7], max_new_tokens=8)
    with pytest.raises(ValueError, match="non-empty list"):
        eng.generate([])
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="--engine vllm needs vLLM"):
            E.make_engine("vllm", model_dir="x")
    with pytest.raises(ValueError, match="unknown engine"):
        E.make_engine("tgi")


def test_attention_over_growing_kv_buckets(models, monkeypatch):
    """Decode reads only the used cache slots, rounded up to KV_BLOCK: with 8-slot blocks a 12-token
    generation crosses several blocks (and on CUDA several graphs); tokens and log-probs must not
    notice."""
    monkeypatch.setattr(R, "KV_BLOCK", 8)
    m = models["nvfp4"]
    eng = R.Engine(m, max_batch=4, max_len=64)
    for s in eng.generate(PROMPTS, max_new_tokens=12, temperature=0.0, stop_token_ids=[]):
        assert is_greedy(m, PROMPTS[s.prompt_idx], s.tokens, 1e-3)
        if DEV == "cpu":
            assert s.tokens == M.greedy(m, PROMPTS[s.prompt_idx], 12)
    for s in eng.generate(PROMPTS, n=2, max_new_tokens=12, temperature=1.0, stop_token_ids=[],
                          seed=2):
        ref = recompute_logprobs(m, PROMPTS[s.prompt_idx], s.tokens, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), ref.cpu(), atol=1e-4)
    if DEV == "cuda":
        assert len({kv for _, kv in eng.graphs}) >= 3
