"""bench/model_speed.py: `python -m bench model | rollout | train` on random weights of the Qwen2.5
shapes: weight memory and a forward + backward; tokens/s of the built-in engine (and of transformers
generate); one RL step.
Needs a CUDA GPU.
"""
import gc
import json
import time

import torch

from bench.common import QWEN, random_model, weight_bytes


def bench_model(out: dict, size: str = "7b"):
    """Weight memory, and a forward + backward over 8 x 1024 tokens with LoRA r32 and
    checkpointing."""
    import lora
    import model as M

    rows = []
    for nv in (True, False):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        m = random_model(size, nv)
        wb = weight_bytes(m)
        lora.add_lora(m, 32, 64)
        m.grad_checkpoint = True
        m.train()
        ids = torch.randint(0, 150000, (8, 1024), device="cuda")
        valid = torch.ones_like(ids, dtype=torch.bool)

        def fwd_bwd():
            h = m.forward_padded(ids, valid)
            lp, _ = M.token_logprobs(m, h.reshape(-1, h.shape[-1]), ids.reshape(-1))
            lp.mean().backward()

        fwd_bwd()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        import triton.testing
        ms = triton.testing.do_bench(fwd_bwd, warmup=1, rep=3, return_mode="median")
        rows.append(dict(base="nvfp4" if nv else "bf16", weights_GB=wb / 1e9, fwd_bwd_ms=ms,
                         peak_GB=torch.cuda.max_memory_allocated() / 1e9))
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                          for k, v in rows[-1].items()}))
        m = None  # free it before the next base is built
    out["model_" + size] = rows


def add_random_lora(m, rank: int):
    """A LoRA of this rank (alpha 2 x rank) on every linear, A and B random and nonzero: the LoRA
    product at its real cost, as an RL rollout carries it."""
    import lora

    lora.add_lora(m, rank, 2.0 * rank, seed=0)
    with torch.no_grad():
        for p_ in lora.lora_parameters(m):
            p_.normal_(0, 0.01)


def decode_bytes(m) -> int:
    """Weight bytes a decode step reads: the embedding is gathered B rows at a time, so it counts
    only where it is tied (the lm_head then reads it all)."""
    emb = m.model.embed_tokens.weight
    return weight_bytes(m) - (0 if m.lm_head is None else emb.numel() * emb.element_size())


def time_engine(m, B: int, prompt: int, new_tokens: int, wb: int, out: dict) -> dict:
    """One built-in engine for m at batch B (its CUDA graphs captured by a first call), then timed:
    tokens/s of B random prompts of `prompt` tokens decoding new_tokens each (EOS ignored), the
    prefill alone, the decode step, its roofline (wb weight bytes + the mean KV cache, at the
    measured copy bandwidth) and the peak memory."""
    import rollout

    eng = rollout.Engine(m, max_batch=B, max_len=prompt + new_tokens)
    prompts = torch.randint(0, 150000, (B, prompt)).tolist()
    # compile + capture the graphs
    eng.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    outs = eng.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[], seed=0)
    torch.cuda.synchronize()
    dt, t0 = time.time() - t0, time.time()
    # the prefill alone
    eng.generate(prompts, max_new_tokens=1, stop_token_ids=[], seed=0)
    torch.cuda.synchronize()
    dt1, toks = time.time() - t0, sum(len(o.tokens) for o in outs)
    c = m.cfg
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * B * (prompt + new_tokens / 2)
    return dict(tok_s=toks / dt, prefill_ms=1e3 * dt1,
                decode_ms_per_step=1e3 * (dt - dt1) / max(new_tokens - 1, 1),
                roofline_ms=(wb + kv) / (out.get("copy_GBps", 3000) * 1e6),
                peak_GB=torch.cuda.max_memory_allocated() / 1e9)


def bench_rollout(out: dict, size: str, batches, new_tokens: int = 512, prompt: int = 256,
                  bases=("nvfp4", "bf16"), hf: bool = True, lora_rank: int = 0):
    """Tokens/s of the built-in engine (NVFP4 vs bf16) and of transformers generate (bf16), EOS
    ignored.
    lora_rank > 0: a LoRA of that rank on every linear, with random nonzero B (as an RL rollout
    carries)."""
    rows = []
    for base in bases:
        m = random_model(size, base == "nvfp4")
        if lora_rank:
            add_random_lora(m, lora_rank)
        wb = decode_bytes(m)
        for B in batches:
            try:
                row = dict(size=size, base=base, lora_rank=lora_rank, batch=B,
                           **time_engine(m, B, prompt, new_tokens, wb, out))
            except torch.cuda.OutOfMemoryError:
                row = dict(size=size, base=base, lora_rank=lora_rank, batch=B, oom=True)
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in row.items()}))
        del m
        torch.cuda.empty_cache()
    if hf:
        rows += bench_hf_generate(size, [b for b in batches if b <= 64], new_tokens, prompt)
    out.setdefault("rollout", []).extend(rows)


def bench_hf_generate(size, batches, new_tokens, prompt):
    import transformers

    cfg = transformers.Qwen2Config(rms_norm_eps=1e-6, max_position_embeddings=32768, **QWEN[size])
    with torch.device("cuda"):
        hf = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    rows = []
    for B in batches:
        ids = torch.randint(0, 150000, (B, prompt), device="cuda")
        hf.generate(ids[:, :8], max_new_tokens=2, do_sample=True, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.time()
        o = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                        pad_token_id=0)
        torch.cuda.synchronize()
        tok_s = B * (o.shape[1] - prompt) / (time.time() - t0)
        rows.append(dict(size=size, base="transformers-bf16", batch=B, tok_s=tok_s))
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                          for k, v in rows[-1].items()}))
    del hf
    torch.cuda.empty_cache()
    return rows


def bench_rl_step(out: dict, size: str = "7b", prompts: int = 8, group: int = 8,
                  prompt_len: int = 256, new_tokens: int = 512, recompute: bool = True,
                  old_logps=("reuse",)):
    """One RL step at fixed lengths (EOS ignored, random rewards): rollout, trainer log-probs, 2
    minibatch updates (the train half once for each --old-logp mode in old_logps)."""
    rows = []
    for base in ("nvfp4", "bf16"):
        try:
            row = rl_step_one(size, base, prompts, group, prompt_len, new_tokens, recompute,
                              old_logps)
        except torch.cuda.OutOfMemoryError:
            # e.g. a bf16 32B base (65 GB) with its KV cache and activations
            row = dict(size=size, base=base, grad_checkpoint=recompute, oom=True)
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    out.setdefault("rl_step", []).extend(rows)


def rl_setup(size, base, prompts, group, prompt_len, new_tokens, recompute):
    import lora
    import rollout

    m = random_model(size, base == "nvfp4")
    params = lora.add_lora(m, 32, 64)
    m.grad_checkpoint = recompute
    eng = rollout.Engine(m, max_batch=prompts * group, max_len=prompt_len + new_tokens)
    return (m, torch.optim.AdamW(params, lr=1e-5), eng,
            torch.randint(0, 150000, (prompts, prompt_len)).tolist())


def rl_batch(eng, P, group, new_tokens, seed):
    import grpo
    import ppo

    samples = eng.generate(P, n=group, max_new_tokens=new_tokens, stop_token_ids=[], seed=seed)
    groups = [dict(prompt=P[i], samples=samples[i * group:(i + 1) * group]) for i in range(len(P))]
    return ppo.make_batch(groups, grpo.group_advantages(torch.rand(len(P), group)),
                          torch.device("cuda"))


# optimizer steps of the benchmark's train half (the dapo preset's two minibatches)
MINIBATCHES = 2


def train_half(m, opt_, b, old_logp: str = "reuse"):
    """The trainer's share of an RL step as train.py runs it: pi_old (ppo.batch_logprobs), then 2
    minibatch updates in micro-batches of 8 (ppo.ppo_update, the dapo preset). old_logp: train.py's
    --old-logp (reuse: the first minibatch's pi_old is its own training forward)."""
    import grpo
    import ppo
    from trainer.config import Config

    S = b["ids"].shape[0]
    cfg = Config(steps=1, minibatches=MINIBATCHES, micro_batch=8, lr=1e-5, old_logp=old_logp,
                 max_new_tokens=b["mask"].shape[1])
    skip = ppo.shuffled_minibatches(cfg, S, 0)[0] if old_logp == "reuse" else None
    b["old_logp"] = ppo.batch_logprobs(m, b, 1.0, 8, entropy=False, skip=skip)[0]     # (S, T)
    ppo.ppo_update(cfg, grpo.apply_preset("dapo", {}), 0, m, b, opt_, torch.arange(S), S,
                   shuffle_seed=0)


# bf16 dense tensor-core peak (FLOP/s) of the GPUs the tables name (H100 / H200 SXM: 989.4 T)
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12}


def train_flops(c, S: int, L: int, T: int, pi_old_share: float = 1.0) -> dict:
    """The matrix work of the train half for S sequences of L tokens, the last T scored, on model
    config c (model.Config): one forward F = linears 2 x params x tokens + causal attention
    (QK^T and PV over the lower triangle) + the LM head over the T scored tokens. The work it must
    do: pi_old (a forward, no gradient), the training forward, and its backward, which for a frozen
    base needs only dX: one forward's work for the linears and the head, two for attention (dQ,
    and dK with dV); the LoRA's own products are left out (under 1% at rank 32). Recomputation
    (gradient checkpointing) is extra: another forward of everything but the head.
    pi_old_share: the share of the rows whose pi_old needs its own forward (--old-logp reuse: all
    but the first minibatch's)."""
    q = c.num_heads * c.head_dim
    kv = c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    lin = 2 * c.num_layers * per_layer * S * L
    attn = c.num_layers * 2 * S * L * L * q          # 2 products x 2 FLOP x L^2 / 2 x q
    head = 2 * c.hidden_size * c.vocab_size * S * T
    fwd = lin + attn + head
    return dict(forward=fwd, needed=pi_old_share * fwd + fwd + (lin + 2 * attn + head),
                recompute=lin + attn)


def rl_step_one(size, base, prompts, group, prompt_len, new_tokens, recompute,
                old_logps=("reuse",)) -> dict:
    """The second of two RL steps (the first compiles and captures): rollout, then the train half
    once for each --old-logp mode of old_logps, on the same batch, timed one after the other."""
    m, opt_, eng, P = rl_setup(size, base, prompts, group, prompt_len, new_tokens, recompute)
    for it in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        b = rl_batch(eng, P, group, new_tokens, it)
        torch.cuda.synchronize()
        t1 = time.time()
        train_s = {}
        for mode in old_logps:
            t = time.time()
            train_half(m, opt_, dict(b), mode)
            torch.cuda.synchronize()
            train_s[mode] = time.time() - t
    first = train_s[old_logps[0]]
    row = dict(size=size, base=base, grad_checkpoint=recompute, old_logp=old_logps[0],
               step_s=t1 - t0 + first, rollout_s=t1 - t0, train_s=first,
               peak_GB=torch.cuda.max_memory_allocated() / 1e9)
    for mode in old_logps[1:]:
        row[f"train_s_{mode}"] = train_s[mode]
    # the train half against the bf16 tensor-core limit of the work each mode must do
    # (train_flops): reuse skips the first minibatch's rows in the pi_old forward
    peak = next((v for k, v in BF16_PEAK.items() if k in torch.cuda.get_device_name()), None)
    for i, mode in enumerate(old_logps):
        share = 1 - 1 / MINIBATCHES if mode == "reuse" else 1.0
        work = train_flops(m.cfg, prompts * group, prompt_len + new_tokens, new_tokens, share)
        tail = "" if i == 0 else f"_{mode}"
        row["train_tflop" + tail] = work["needed"] / 1e12
        if peak:
            row["train_limit_s" + tail] = work["needed"] / peak
            row["train_of_limit" + tail] = row["train_limit_s" + tail] / train_s[mode]
    return row
