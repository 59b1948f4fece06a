"""bench.py: the GPU measurements behind the README's results table (random weights of real shapes).

    python bench.py kernels                 # NVFP4 GEMM vs torch bf16 at the Qwen2.5-7B linear shapes, dgrad, RMSNorm
    python bench.py kernels --sweep         # also try the candidate tile configs per (shape, M) and print the best
    python bench.py kernels --parts ablate  # the GEMM with one stage changed (token traffic, split-K fixup)
    python bench.py kernels --parts splits  # every split-K count per shape at M = 1 / 16 / 64
    python bench.py kernels --parts ws      # kernels_ws's warp-specialized GEMM vs the Triton one, 32-768 tokens
    python bench.py kernels --parts stamps  # where kernels_ws's programs spend their time (global-timer stamps)
    python bench.py model | rollout | train # memory and fwd + bwd; tokens/s of generation; one RL step (see --help)
    python bench.py profile [--train nvfp4] # where a decode step (or an RL step's train half) spends its time
    python bench.py kernels --parts attn    # decode attention (attention.py) vs torch SDPA

At M <= 64 the GEMM table also times cuBLAS bf16 on a weight of as many bytes as the NVFP4 one (9/32 of the rows:
"same-bytes bound") and a kernel that only streams the NVFP4 words and scales ("read floor", an estimate).
Timing: CUDA graphs of many calls (launch gaps excluded), the median of several replays, the two sides of a ratio
replayed in turn (paired_us); weights rotate over enough copies that every call reads them from HBM, not L2 (50 MB).
Speedups are ours / torch bf16 measured in the same run. Needs a CUDA GPU.
"""
import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import fsutil

SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
SHAPES_32B = {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (55296, 5120), "down": (5120, 27648)}
L2_BYTES = 50 * 2**20


def graph_time_us(calls, reps: int = 5, replays: int = 7) -> float:
    """Median microseconds per call of `calls` (a list of closures), captured in one CUDA graph."""
    return paired_us(calls, reps=reps, replays=replays)[0]


def paired_us(*call_lists, reps: int = 5, replays: int = 7) -> list[float]:
    """Median microseconds per call of each list of closures, one CUDA graph per list, the graphs replayed in turn
    (a, b, a, b, ...): a compute-bound GEMM runs at the power limit, whose clock drifts as the GPU warms, so timing
    one side after the other would favour the first."""
    graphs = []
    for calls in call_lists:
        for f in calls:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                for f in calls:
                    f()
        graphs.append(g)
    times = [[] for _ in call_lists]
    for _ in range(replays):
        for g, calls, tl_ in zip(graphs, call_lists, times):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            tl_.append(a.elapsed_time(b) * 1e3 / (reps * len(calls)))
    del graphs
    return [statistics.median(t) for t in times]


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(3 * L2_BYTES / nbytes))


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (GB/s)."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)], reps=3)
    return 2 * src.numel() * 4 / us / 1e3


def random_nvfp4(N, K, copies):
    import kernels
    import quantize

    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, scale, gs = quantize.quantize_weight(w)
    base = kernels.pack_nvfp4(packed, scale, gs.cuda())
    ws = [base] + [kernels.NVFP4Weight(base.words.clone(), base.scales.clone(), base.global_scale.clone(), N, K)
                   for _ in range(copies - 1)]
    return w, ws


def bench_gemm(Ms, sweep: str | None, out: dict, shapes: dict = SHAPES_7B):
    import bench_sweep
    import kernels

    out["copy_GBps"] = bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s")
    rows, best_cfgs = [], {}
    if sweep:
        bench_sweep.precompile([M for M in Ms if M < kernels.LARGE_M], 12, sweep, shapes)
    for name, (N, K) in shapes.items():
        w_bf16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wb = [w_bf16] + [w_bf16.clone() for _ in range(copies_for(N * K * 2) - 1)]
        _, wq = random_nvfp4(N, K, copies_for(N * K * 9 // 16))
        rows_eq = N * K * 9 // 16 // (2 * K)                  # a bf16 weight holding as many bytes as the NVFP4 one
        weq = [torch.randn(rows_eq, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(rows_eq * K * 2))]
        t_read = bench_sweep.read_floor_us(wq) if min(Ms) <= 64 else None
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_bf16, t_ours = paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                       [lambda w=w: kernels.nvfp4_linear(x, w) for w in wq])
            gbs = N * K * 9 / 16 / t_ours / 1e3
            row = dict(shape=name, M=M, bf16_us=t_bf16, nvfp4_us=t_ours, speedup=t_bf16 / t_ours, nvfp4_GBps=gbs)
            if M <= 64:  # the bound a perfect W4 kernel meets: cuBLAS reading as many bytes (9/32 of the rows)
                t_eq = graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in weq])
                row.update(same_bytes_bf16_us=t_eq, bound_speedup=t_bf16 / t_eq, read_floor_us=t_read,
                           floor_speedup=t_bf16 / t_read)
            cands = bench_sweep.sweep_configs(M, N, K, sweep) if sweep and M < kernels.LARGE_M else []
            if cands:  # (the ks family has none above 16 tokens)
                res = []
                for cfg in cands:
                    try:
                        t = graph_time_us([lambda w=w, c=cfg: kernels.nvfp4_mm(x, w, config=c) for w in wq], reps=3)
                    except Exception as e:  # a config that does not fit (shared memory) is skipped
                        print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    res.append((t, cfg))
                res.sort(key=lambda r: r[0])
                row["best_cfg"], row["best_us"] = res[0][1], res[0][0]
                row["sweep"] = [(round(t, 2), c) for t, c in res]
                best_cfgs[f"{name}/{M}"] = res[0][1]
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "sweep"}))
            sys.stdout.flush()
    out["gemm"] = rows
    if sweep:
        out["best_cfgs"] = best_cfgs
    print("\n| M | " + " | ".join(shapes) + " | geomean | same-bytes bound | read floor |\n|---|"
          + "---|" * (len(shapes) + 3))
    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    for M in Ms:
        sp = [r["speedup"] for r in rows if r["M"] == M]
        bd = [r["bound_speedup"] for r in rows if r["M"] == M and "bound_speedup" in r]
        fl = [r["floor_speedup"] for r in rows if r["M"] == M and "floor_speedup" in r]
        cells = [", ".join(f"{s:.2f}x" for s in v) + f" (geomean {gm(v):.2f}x)" if v else "-" for v in (bd, fl)]
        bound = " | ".join(cells)
        print(f"| {M} | " + " | ".join(f"{s:.2f}x" for s in sp) + f" | {gm(sp):.2f}x | {bound} |")
    return rows


def bench_dgrad(out: dict):
    import kernels

    rows = []
    for name, (N, K) in SHAPES_7B.items():
        _, (wq,) = random_nvfp4(N, K, 1)
        wb = kernels.dequantize(wq)
        for M in (4096, 16384):
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            t_bf16, t_ours = paired_us([lambda: dy @ wb], [lambda: dy @ kernels.dequantize(wq)], reps=2, replays=5)
            t_deq = graph_time_us([lambda: kernels.dequantize(wq)], reps=3)
            rows.append(dict(shape=name, M=M, bf16_us=t_bf16, nvfp4_us=t_ours, ratio=t_bf16 / t_ours,
                             dequant_us=t_deq, dequant_GBps=N * K * (2 + 9 / 16) / t_deq / 1e3))
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
    out["dgrad"] = rows


def bench_rmsnorm(out: dict):
    import ops

    rows = []
    M = 16384
    bw = out.get("copy_GBps") or copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s")
    for H in (3584, 5120):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(H, device="cuda") * 0.01
        t_f = graph_time_us([lambda: ops.rms_norm(x, w, 1e-6, z)], reps=5)
        t_fr = graph_time_us([lambda: ops.rms_norm(x, w, 1e-6, z, r)], reps=5)
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = ops.rms_norm(xg, wg, 1e-6, z)
        dy = torch.randn_like(y)
        ctx = y.grad_fn  # the autograd node of ops._RMSNorm: its backward (dX and dW) called directly, in a graph
        assert type(ctx).__name__ == "_RMSNormBackward", type(ctx).__name__
        t_b = graph_time_us([lambda: ops._RMSNorm.backward(ctx, dy)], reps=5)
        t_ref = graph_time_us([lambda: ops.rms_norm_ref(x, w, 1e-6, z)], reps=5)
        nb = M * H * 2
        rows.append(dict(H=H, M=M, fwd_GBps=2 * nb / t_f / 1e3, fwd_res_GBps=4 * nb / t_fr / 1e3,
                         bwd_GBps=3 * nb / t_b / 1e3, fwd_us=t_f, bwd_us=t_b, torch_ref_fwd_us=t_ref))
        rows[-1].update(fwd_of_copy=rows[-1]["fwd_GBps"] / bw, bwd_of_copy=rows[-1]["bwd_GBps"] / bw)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
    out["rmsnorm"] = rows


# ----------------------------------------------------------------------------------------------------------------
# Model, rollout and RL-step benchmarks on random weights of real shapes

QWEN = {"7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
        "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                    num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)}


def random_model(size: str, nvfp4: bool):
    """A Qwen2.5-shaped model.Model with random weights on the GPU (quantized layer by layer when nvfp4)."""
    import kernels
    import model as M
    import quantize

    cfg = M.config_from_hf(dict(architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6, rope_theta=1e6,
                                max_position_embeddings=32768, eos_token_id=151645, **QWEN[size]))
    with torch.device("meta"):
        m = M.Model(cfg).to(torch.bfloat16)
    m.to_empty(device="cuda")
    m.inv_freq = M.rope_inv_freq(cfg).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p_ in m.parameters():
            p_.normal_(0, 0.02, generator=g) if p_.dim() == 2 else p_.fill_(1.0)
        for layer in m.model.layers:
            lins = {n: lin for n, lin in layer.named_modules() if isinstance(lin, M.Linear)}
            w = {n: torch.randn(lin.out_features, lin.in_features, device="cuda", generator=g).mul_(0.02).to(torch.bfloat16)
                 for n, lin in lins.items()}
            for n, lin in lins.items():
                if lin.has_bias:
                    lin.bias = torch.zeros(lin.out_features, device="cuda", dtype=torch.bfloat16)
            if nvfp4:
                q, _ = quantize.quantize_state_dict({f"model.layers.0.{n}.weight": t for n, t in w.items()}, device="cuda")
                for n, lin in lins.items():
                    k = f"model.layers.0.{n}."
                    lin.words, lin.scales, lin.global_scale, *_ = kernels.pack_nvfp4(
                        q[k + "weight_packed"].cuda(), q[k + "weight_scale"].cuda(), q[k + "weight_global_scale"].cuda())
            else:
                for n, lin in lins.items():
                    lin.weight = w[n]
            del w
            M.fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
            M.fuse(layer.mlp, ("gate_proj", "up_proj"))
    torch.cuda.empty_cache()
    return m.eval()


def weight_bytes(m) -> int:
    seen, total = set(), 0
    for t in list(m.parameters()) + list(m.buffers()):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def bench_model(out: dict, size: str = "7b"):
    """Weight memory, and a forward + backward over 8 x 1024 tokens with LoRA r32 and checkpointing."""
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
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
        m = None  # free it before the next base is built
    out["model_" + size] = rows


def bench_rollout(out: dict, size: str, batches, new_tokens: int = 512, prompt: int = 256, bases=("nvfp4", "bf16"),
                  hf: bool = True):
    """Tokens/s of the built-in engine (NVFP4 vs bf16) and of transformers generate (bf16), EOS ignored."""
    import rollout

    rows = []
    for base in bases:
        m = random_model(size, base == "nvfp4")
        emb = m.model.embed_tokens.weight  # a decode step gathers B rows of it (unless tied: the lm_head reads it all)
        wb = weight_bytes(m) - (0 if m.lm_head is None else emb.numel() * emb.element_size())   # bytes a step reads
        for B in batches:
            try:
                eng = rollout.Engine(m, max_batch=B, max_len=prompt + new_tokens)
                prompts = torch.randint(0, 150000, (B, prompt)).tolist()
                eng.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])  # compile + capture the graphs
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.time()
                outs = eng.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[], seed=0)
                torch.cuda.synchronize()
                dt, t0 = time.time() - t0, time.time()
                eng.generate(prompts, max_new_tokens=1, stop_token_ids=[], seed=0)   # the prefill alone
                torch.cuda.synchronize()
                dt1, toks = time.time() - t0, sum(len(o.tokens) for o in outs)
                kv = 2 * m.cfg.num_layers * m.cfg.num_kv_heads * m.cfg.head_dim * 2 * B * (prompt + new_tokens / 2)
                row = dict(size=size, base=base, batch=B, tok_s=toks / dt, prefill_ms=1e3 * dt1,
                           decode_ms_per_step=1e3 * (dt - dt1) / max(new_tokens - 1, 1),
                           roofline_ms=(wb + kv) / (out.get("copy_GBps", 3000) * 1e6),
                           peak_GB=torch.cuda.max_memory_allocated() / 1e9)
                del eng
            except torch.cuda.OutOfMemoryError:
                row = dict(size=size, base=base, batch=B, oom=True)
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
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
        o = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
        torch.cuda.synchronize()
        rows.append(dict(size=size, base="transformers-bf16", batch=B, tok_s=B * (o.shape[1] - prompt) / (time.time() - t0)))
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
    del hf
    torch.cuda.empty_cache()
    return rows


def bench_rl_step(out: dict, size: str = "7b", prompts: int = 8, group: int = 8, prompt_len: int = 256, new_tokens: int = 512,
                  recompute: bool = True):
    """One RL step at fixed lengths (EOS ignored, random rewards): rollout, trainer log-probs, 2 minibatch updates."""
    rows = []
    for base in ("nvfp4", "bf16"):
        try:
            row = _rl_step_one(size, base, prompts, group, prompt_len, new_tokens, recompute)
        except torch.cuda.OutOfMemoryError:   # e.g. a bf16 32B base (65 GB) with its KV cache and activations
            row = dict(size=size, base=base, grad_checkpoint=recompute, oom=True)
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    out.setdefault("rl_step", []).extend(rows)


def _rl_setup(size, base, prompts, group, prompt_len, new_tokens, recompute):
    import lora
    import rollout

    m = random_model(size, base == "nvfp4")
    params = lora.add_lora(m, 32, 64)
    m.grad_checkpoint = recompute
    eng = rollout.Engine(m, max_batch=prompts * group, max_len=prompt_len + new_tokens)
    return m, torch.optim.AdamW(params, lr=1e-5), eng, torch.randint(0, 150000, (prompts, prompt_len)).tolist()


def _rl_batch(eng, P, group, new_tokens, seed):
    import grpo
    import train

    samples = eng.generate(P, n=group, max_new_tokens=new_tokens, stop_token_ids=[], seed=seed)
    groups = [dict(prompt=P[i], samples=samples[i * group:(i + 1) * group]) for i in range(len(P))]
    return train.make_batch(groups, grpo.group_advantages(torch.rand(len(P), group)), torch.device("cuda"))


def _train_half(m, opt_, b):
    """The trainer's share of an RL step: log-probs of the rollout policy, then 2 minibatch updates (micro-batches of 8)."""
    import grpo
    import train

    S = b["ids"].shape[0]
    with torch.no_grad():
        old = torch.cat([train.policy_logprobs(m, b, c, 1.0)[0] for c in torch.arange(S, device="cuda").split(8)])
    m.train()
    for mb in torch.arange(S, device="cuda").chunk(2):
        for c in mb.split(8):
            lp, _ = train.policy_logprobs(m, b, c, 1.0)
            loss, _ = grpo.policy_loss(lp, old[c], b["adv"][c], b["mask"][c], agg="token_mean",
                                       num_tokens=b["mask"][mb].sum().item())
            loss.backward()
        opt_.step()
        opt_.zero_grad(set_to_none=True)
    m.eval()


def _rl_step_one(size, base, prompts, group, prompt_len, new_tokens, recompute) -> dict:
    m, opt_, eng, P = _rl_setup(size, base, prompts, group, prompt_len, new_tokens, recompute)
    for it in range(2):  # the first step includes compilation and graph capture; report the second
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        b = _rl_batch(eng, P, group, new_tokens, it)
        torch.cuda.synchronize()
        t1 = time.time()
        _train_half(m, opt_, b)
        torch.cuda.synchronize()
        t2 = time.time()
    return dict(size=size, base=base, grad_checkpoint=recompute, step_s=t2 - t0, rollout_s=t1 - t0, train_s=t2 - t1,
                peak_GB=torch.cuda.max_memory_allocated() / 1e9)


def main(argv=None):
    ap = argparse.ArgumentParser(description="nanoqerl GPU benchmarks (print measured numbers; need a CUDA GPU).")
    ap.add_argument("what", choices=["kernels", "model", "rollout", "train", "one", "profile"],
                    help="kernels: GEMM/dgrad/RMSNorm tables; model: memory and fwd+bwd; rollout: tokens/s; "
                         "train: one RL step; one: a single GEMM (for profilers); profile: CUDA time per kernel of a "
                         "decode step (--size, first of --batches) or of an RL step's train half (--train)")
    ap.add_argument("--size", default="7b", choices=sorted(QWEN),
                    help="model shape for model / rollout / train, and the linear shapes of `kernels --parts gemm`")
    ap.add_argument("--batches", default="1,16,64,256", help="with rollout: batch sizes (sequences)")
    ap.add_argument("--new-tokens", type=int, default=512, help="with rollout / train: tokens generated per sequence")
    ap.add_argument("--no-hf", action="store_true", help="with rollout: skip transformers generate")
    ap.add_argument("--no-grad-checkpoint", action="store_true",
                    help="with train: keep every layer's activations instead of recomputing them in backward")
    ap.add_argument("--lora-rank", type=int, default=0, help="with profile: LoRA of this rank on every linear")
    ap.add_argument("--train", default=None, choices=["nvfp4", "bf16"],
                    help="with profile: the train half of `bench.py train` (this base) instead of a decode step")
    ap.add_argument("--prefill", action="store_true",
                    help="with profile: host time of the eager prefill (first of --batches), NVFP4 and bf16")
    ap.add_argument("--ab", default=None, choices=["attn", "silu", "rope"], help="with profile: the decode step with "
                    "a knob on and off, same run (--batches): attn: our decode attention vs torch SDPA; silu: SiLU x up "
                    "in gate_up's epilogue vs a kernel of its own; rope: RoPE + cache write in the attention or not")
    ap.add_argument("--shape", default="gate_up", choices=sorted(SHAPES_7B), help="with `one`: the 7B linear shape")
    ap.add_argument("--config", default=None, help="with `one`: a JSON tile config (default: the dispatch table)")
    ap.add_argument("--iters", type=int, default=3, help="with `one`: calls to make (each of ours and of F.linear)")
    ap.add_argument("--sweep", nargs="?", const="all", default=None, choices=["all", "wgmma", "mma", "ks"],
                    help="also time the candidate GEMM configs per (shape, M); optionally only the wgmma (4-8 warps) "
                         "or the mma.sync (1-2 warps or BN < 64) family, or the K-sliced kernel's configs (ks)")
    ap.add_argument("--m", default="1,16,64,256,4096", help="token counts M for the GEMM table")
    ap.add_argument("--parts", default="gemm,dgrad,rmsnorm",
                    help="which kernel benchmarks to run (comma list of gemm, dgrad, rmsnorm; also ablate: the GEMM "
                         "with one stage changed, splits: every split-K count at M = 1 / 16 / 64, ws: the "
                         "warp-specialized GEMM of kernels_ws against the Triton one, stamps: where its programs' "
                         "time goes, sampler: ops.race_sample chunked vs one program a row, attn: decode attention vs "
                         "SDPA; see bench_sweep)")
    ap.add_argument("--ws-m", default="32,48,64,96,128,160,192,224,256,384,512,768",
                    help="with --parts ws: token counts M")
    ap.add_argument("--json", default=None, help="also write all numbers to this JSON file")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    if not torch.cuda.is_available():
        print("error: bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.what in ("profile", "one"):
        import bench_profile
        return bench_profile.run(args) or 0
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.what in ("model", "rollout", "train"):
        out["copy_GBps"] = copy_bandwidth()
        print(f"device {torch.cuda.get_device_name()}  copy bandwidth {out['copy_GBps']:.0f} GB/s")
        if args.what == "model":
            bench_model(out, args.size)
        elif args.what == "rollout":
            bench_rollout(out, args.size, [int(b) for b in args.batches.split(",")], args.new_tokens, hf=not args.no_hf)
        else:
            bench_rl_step(out, args.size, new_tokens=args.new_tokens, recompute=not args.no_grad_checkpoint)
    parts = args.parts.split(",") if args.what == "kernels" else []
    if "gemm" in parts:
        shapes = SHAPES_32B if args.size == "32b" else SHAPES_7B
        bench_gemm([int(m) for m in args.m.split(",")], args.sweep, out, shapes)
    if "dgrad" in parts:
        bench_dgrad(out)
    if "rmsnorm" in parts:
        bench_rmsnorm(out)
    import bench_sweep
    ws_m = [int(m) for m in args.ws_m.split(",")]
    for part, run in (("stamps", bench_sweep.stamps), ("ws", lambda o: bench_sweep.ws(o, ws_m)),
                      ("ablate", bench_sweep.ablate), ("splits", bench_sweep.splits), ("sampler", bench_sweep.sampler),
                      ("attn", bench_sweep.attn)):
        if part in parts:
            run(out)
    if args.json:
        fsutil.atomic_write_text(Path(args.json), json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
