"""bench/profiling.py: where the time goes, for `python -m bench profile` and `python -m bench one`
(needs a CUDA GPU).

    python -m bench profile --batches 1                  # CUDA time per kernel of a 7B NVFP4 decode
                                                         # step at batch 1
    python -m bench profile --batches 64 --lora-rank 32  # the same with the RL step's LoRA on every
                                                         # linear
    python -m bench profile --train nvfp4                # the train half of `python -m bench train`
                                                         # (or --train bf16)
    ncu -k regex:nvfp4 python -m bench one --shape gate_up --m 1   # a few plain calls of one GEMM,
                                                                   # for Nsight Compute
    python -m bench one --shape qkv --m 256 --iters 200          # also: host time per call, ours vs
                                                                 # F.linear
    python -m bench profile --prefill --batches 1        # host time of the eager prefill, NVFP4 vs
                                                         # bf16 (cProfile)
    python -m bench profile --ab attn --batches 1,16,64  # decode step with
                                                         # attention.decode_attention vs torch SDPA
    python -m bench profile --ab silu --batches 1,8,16,32 # decode step with SiLU x up in gate_up's
                                                          # epilogue or not
    python -m bench profile --ab rope --batches 1,16,64  # decode step with RoPE + cache write in
                                                         # the attention or not
"""
import json
import statistics
import time

import torch

from bench.common import SHAPES_7B, random_model, random_nvfp4
from bench.model_speed import rl_batch, rl_setup, train_half


def run(args):
    """`python -m bench one` and `python -m bench profile`, as their flags ask (see
    python -m bench --help)."""
    batches = [int(b) for b in args.batches.split(",")]
    if args.what == "one":
        return run_one(args.shape, int(args.m.split(",")[0]), args.config, args.iters)
    if args.ab:
        return engine_ab(args.size, batches, args.ab)
    if args.prefill:
        return profile_prefill(args.size, batches[0])
    if args.train:
        return profile_train(args.size, args.train)
    return profile_decode(args.size, batches[0], lora_rank=args.lora_rank)


def run_one(shape: str, M: int, config: str | None, iters: int):
    """A few plain calls of one GEMM, for profilers
    (ncu -k regex:nvfp4 python -m bench one --shape gate_up --m 1), then as many of bf16 F.linear;
    prints the host time per call of each (what an eager prefill pays per linear)."""
    import kernels
    from gemm import configs

    N, K = SHAPES_7B[shape]
    _, (w,) = random_nvfp4(N, K, 1)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    cfg = json.loads(config) if config else None
    wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    host = {}
    ours = ((lambda: kernels.nvfp4_mm(x, w, config=cfg)) if cfg
            else (lambda: kernels.nvfp4_linear(x, w)))
    for name, f in (("nvfp4_mm" if cfg else "nvfp4_linear", ours),
                    ("F.linear bf16", lambda: torch.nn.functional.linear(x, wb))):
        f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            f()
        # launch cost on the host (no sync in the loop)
        host[name] = (time.perf_counter() - t0) / iters * 1e6
        torch.cuda.synchronize()
    print(f"ran {iters} x {shape} M={M} config={cfg or configs.mm_config(M, N, K)}; "
          "host time per call: "
          + ", ".join(f"{k} {v:.1f} us" for k, v in host.items()))


def profile_decode(size: str, B: int, prompt: int = 256, steps: int = 32, lora_rank: int = 0):
    """Where a decode step's time goes: CUDA time per kernel over `steps` eager decode steps (NVFP4,
    batch B; with lora_rank, LoRA of that rank on every linear, as in `python -m bench train`)."""
    import lora
    import rollout
    from torch.profiler import ProfilerActivity, profile

    m = random_model(size, True)
    if lora_rank:
        lora.add_lora(m, lora_rank, 2 * lora_rank)
    eng = rollout.Engine(m, max_batch=B, max_len=prompt + 512, cuda_graphs=False)
    P = torch.randint(0, 150000, (B, prompt)).tolist()
    eng.generate(P, max_new_tokens=4, stop_token_ids=[])  # compile
    eng.generate(P, max_new_tokens=1, stop_token_ids=[])  # the prefill alone, to subtract
    with profile(activities=[ProfilerActivity.CUDA]) as p0:
        eng.generate(P, max_new_tokens=1, stop_token_ids=[])
    with profile(activities=[ProfilerActivity.CUDA]) as p1:
        eng.generate(P, max_new_tokens=steps + 1, stop_token_ids=[])
    print_kernel_table([(-1, p0), (1, p1)], steps,
                       f"{size} NVFP4{f' + LoRA r{lora_rank}' if lora_rank else ''} batch {B}",
                       "decode step (eager)")


def profile_prefill(size: str, B: int, prompt: int = 256):
    """Where an eager prefill's wall time goes on the host: the prefill (generate with one new
    token) of both bases timed, then profiled with cProfile (the functions with the most time of
    their own)."""
    import cProfile
    import pstats
    import rollout

    for base in ("nvfp4", "bf16"):
        m = random_model(size, base == "nvfp4")
        eng = rollout.Engine(m, max_batch=B, max_len=prompt + 8)
        P = torch.randint(0, 150000, (B, prompt)).tolist()
        walls = []
        for _ in range(6):  # the first compiles
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate(P, max_new_tokens=1, stop_token_ids=[])
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t0))
        print(f"{size} {base} batch {B} prefill of {prompt} tokens: "
              f"wall ms {[round(w, 1) for w in walls[1:]]}")
        with cProfile.Profile() as pr:
            eng.generate(P, max_new_tokens=1, stop_token_ids=[])
            torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)
        del eng, m
        torch.cuda.empty_cache()


def engine_ab(size: str, batches, knob: str, prompt: int = 256, new_tokens: int = 512,
              reps: int = 3):
    """The engine's decode step with a knob on and off, same run: two engines on one model, their
    graphs captured once each (the knob set as named), then generate calls alternated; decode step =
    (a 512-token call - a 1-token call) / 511, the median over `reps` pairs. knob attn:
    attention.decode_attention vs torch SDPA (NVFP4 and bf16, so the ratio of the two is also
    shown); silu: SiLU x up in gate_up's epilogue (kernels.nvfp4_mm(gated=)) vs ops.silu_mul after
    it (NVFP4); rope: RoPE and the cache write inside the attention kernel vs ops.rope_cache
    (NVFP4)."""
    from layers import attention
    import kernels
    import rollout

    usable, fusable, gmax, step = attention.usable, attention.rope_fusable, kernels.GATED_MAX_M, {}
    knobs = {"attn": {"kernel": lambda: None,
                      "sdpa": lambda: setattr(attention, "usable", lambda *a, **k: False)},
             "silu": {"epilogue": lambda: None,
                      "separate": lambda: setattr(kernels, "GATED_MAX_M", 0)},
             "rope": {"in-kernel": lambda: None,
                      "separate": lambda: setattr(attention, "rope_fusable",
                                                  lambda *a, **k: False)}}[knob]
    names = list(knobs)
    for base in ("nvfp4", "bf16") if knob == "attn" else ("nvfp4",):
        m = random_model(size, base == "nvfp4")
        for B in batches:
            P = torch.randint(0, 150000, (B, prompt)).tolist()
            engs, ts = {}, {name: [] for name in names}
            for name, setup in knobs.items():
                setup()
                engs[name] = rollout.Engine(m, max_batch=B, max_len=prompt + new_tokens)
                # capture its graphs
                engs[name].generate(P, max_new_tokens=new_tokens, stop_token_ids=[])
                attention.usable = usable
                attention.rope_fusable = fusable
                kernels.GATED_MAX_M = gmax
            for _ in range(reps):
                for name, eng in engs.items():
                    walls = []
                    for n in (new_tokens, 1):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        eng.generate(P, max_new_tokens=n, stop_token_ids=[], seed=0)
                        torch.cuda.synchronize()
                        walls.append(time.perf_counter() - t0)
                    ts[name].append(1e3 * (walls[0] - walls[1]) / (new_tokens - 1))
            for name in ts:
                step[(base, B, name)] = statistics.median(ts[name])
            print(f"{size} {base} batch {B}: decode step "
                  + ", ".join(f"{step[(base, B, n)]:.3f} ms {n}" for n in names)
                  + f" ({step[(base, B, names[1])] / step[(base, B, names[0])]:.3f}x; "
                    f"medians of {reps}: {ts})")
            del engs
            torch.cuda.empty_cache()
        del m
        torch.cuda.empty_cache()
    for B in batches if knob == "attn" else ():
        r = [step[("bf16", B, n)] / step[("nvfp4", B, n)] for n in names]
        print(f"batch {B}: NVFP4 / bf16 decode speed {r[0]:.2f}x with decode_attention, "
              f"{r[1]:.2f}x with SDPA")


def print_kernel_table(profs, per: int, what: str, unit: str):
    """CUDA time and launches per kernel, summed over (sign, profiler) pairs, per `unit` (per of
    them profiled)."""
    t, n = {}, {}
    for sign, prof in profs:
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
                t[e.key] = t.get(e.key, 0.0) + sign * e.self_device_time_total
                n[e.key] = n.get(e.key, 0) + sign * e.count
    # a kernel whose launches cancel out ran only in the subtracted profile (the prefill): its time
    # difference is run-to-run noise of that profile, not part of the unit
    t = {k: v for k, v in t.items() if n[k] > 0 and v > 0}
    total, launches = sum(t.values()), sum(n[k] for k in t)
    print(f"{what}: {total / per / 1e3:.3f} ms of kernels "
          f"in {launches / per:.0f} launches per {unit}")
    for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{v / per / 1e3:9.3f} ms {100 * v / total:5.1f}% {n[k] / per:7.1f}x  {k[:100]}")


def profile_train(size: str, base: str):
    """Where the train half of `python -m bench train` goes: CUDA time per kernel of one train half
    (after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    m, opt_, eng, P = rl_setup(size, base, 8, 8, 256, 512, True)
    b = rl_batch(eng, P, 8, 512, 0)
    train_half(m, opt_, b)
    torch.cuda.synchronize()
    t0 = time.time()
    train_half(m, opt_, b)
    torch.cuda.synchronize()
    print(f"train half: {time.time() - t0:.2f} s wall")
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        train_half(m, opt_, b)
        torch.cuda.synchronize()
    print_kernel_table([(1, p)], 1, f"{size} {base} + LoRA r32, 8 x 8 sequences of 256 + 512",
                       "train half")
