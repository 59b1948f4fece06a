"""bench/lora_speed.py (python -m bench kernels --parts lora): what a rank-r LoRA costs each fused
linear of a decode step, and which way of computing its A product costs least.

    python -m bench kernels --parts lora                  # 7B groups, M = 1 / 16 / 64, rank 32
    python -m bench kernels --parts lora --m 1 --size 32b

For each fused group of the shape (q/k/v: rank x 3, o: rank, gate/up: rank x 2, down: rank) and M
decode tokens, CUDA-graph times (bench/common.paired_us, every side replayed in turn) of:
    gemm         kernels.nvfp4_mm without LoRA (the base)
    gemm+B       the same GEMM adding xa @ B^T in its epilogue (xa given): what the B product
                 costs there
    xA^T         x @ A^T with A (R, K) as the adapter snapshot stores it (today's A product)
    xAt          x @ At with At = A^T stored contiguous (K, R)
    (Ax^T)^T     A @ x^T, transposed: the other operand order
    shrink       layers/shrink.lora_shrink: one Triton launch (split-K fixed up by its last program)
    best cfg     the fastest of lora_shrink's other configs (SHRINK_SWEEP, layers/shrink.NO_SPILL
                 first), its time and name (columns a step x steps a program, warps); every
                 config's time in the JSON rows
    read A       the bytes of A at the measured copy bandwidth: the floor of any A product
Then the norm before q/k/v and gate/up (norm_rows): alone, followed by the A product (cuBLAS,
shrink), and with it in the same launch (layers/shrink.rms_norm_lora).
Weights and adapters rotate over enough copies that every call reads them from HBM, as the
layers of a real step do. The LoRA's share of the group: (gemm+B - gemm + the A product) / gemm.
Prints one row per (group, M) and adds the rows to --json.

    python -m bench rollout --lora-paths --lora-rank 32 --no-hf   # the whole decode step

rollout_paths: the same question for the engine's whole rollout, in one process on one model (NVFP4,
random weights, a random nonzero LoRA on every linear): tokens/s with the adapters off and on
through each way of the A product (cuBLAS; layers/shrink.lora_shrink at every size, "shrink2"
with its no-spill config; also
the norm-fused products of NANOQERL_LORA_NORM=1, and o_proj's made by the decode attention,
NANOQERL_LORA_ATTN=1; "fused": each A product in its GEMM's launch up to 64 tokens, gemm/fused_a,
NANOQERL_LORA_FUSED=1, the one-launch shrink above), every path (or those of --paths) timed once a
round, in turn, over --rounds rounds (odd rounds in reverse order); each path's cost is 1 - its
tok/s / the adapters-off tok/s of the same round, and the median over rounds is printed. Needs a
CUDA GPU.
"""
import statistics

import torch

from bench.common import (SHAPES_32B, SHAPES_7B, copies_for, copy_bandwidth, paired_us,
                          random_model, random_nvfp4)
from layers.shrink import NO_SPILL

# the rollout's LoRA paths: adapters on?, layers/shrink.SHRINK_M (lora_shrink up to that many
# tokens: every size, or none), .NORM, .ATTN, .FUSED, .CONFIG (lora_shrink's config)
ALWAYS = 1 << 30
PATHS = {"off": (False, 0, False, False, False, None),
         "cublas": (True, 0, False, False, False, None),
         "shrink": (True, ALWAYS, False, False, False, None),
         "shrink2": (True, ALWAYS, False, False, False, NO_SPILL),
         "shrink+norm": (True, ALWAYS, True, False, False, None),
         "shrink+norm+attn": (True, ALWAYS, True, True, False, None),
         "fused": (True, ALWAYS, False, False, True, None)}
SWITCHES = ("SHRINK_M", "NORM", "ATTN", "FUSED", "CONFIG")

# rank multiples of each fused group: q/k/v and gate/up stack their members' A
MEMBERS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
# lora_shrink's configs timed beside its default (layers/shrink.BK, STEPS_PER_PROGRAM, 4 warps):
# columns a step x the most steps a program takes (so, programs over K), warps. Named BKxSTEPSwW
SHRINK_SWEEP = [NO_SPILL, {"BK": 32, "STEPS": 8, "num_warps": 8},
                {"BK": 32, "STEPS": 4, "num_warps": 4}, {"BK": 64, "STEPS": 4, "num_warps": 8},
                {"BK": 32, "STEPS": 32, "num_warps": 8}, {"BK": 16, "STEPS": 16, "num_warps": 4}]


def config_name(c: dict) -> str:
    return f"{c['BK']}x{c['STEPS']}w{c['num_warps']}"


def lora(out: dict, Ms=(1, 16, 64), size: str = "7b", rank: int = 32):
    import kernels
    from layers.shrink import lora_shrink

    bw = out.get("copy_GBps") or copy_bandwidth()
    shapes = SHAPES_32B if size == "32b" else SHAPES_7B
    rows = []
    print(f"LoRA rank {rank} in the decode step's fused linears ({size}), microseconds a call")
    print(f"{'group':>8} {'M':>3} {'gemm':>7} {'gemm+B':>7} {'xA^T':>7} {'xAt':>7} "
          f"{'(Ax^T)^T':>9} {'shrink':>7} {'best cfg':>16} {'read A':>7} {'LoRA share':>10}")
    for name, (N, K) in shapes.items():
        R = rank * MEMBERS[name]
        _, wq = random_nvfp4(N, K, copies_for(N * K * 9 // 16))
        n_a = copies_for(R * K * 2)
        A = [torch.randn(R, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_a)]
        At = [a.t().contiguous() for a in A]                                 # (K, R) each
        B = [torch.randn(N, R, device="cuda", dtype=torch.bfloat16) * 0.02
             for _ in range(copies_for(N * R * 2))]
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)      # (M, K)
            xa = torch.randn(M, R, device="cuda", dtype=torch.bfloat16)     # (M, R)
            t_gemm, t_b, t_now, t_nn, t_rev, t_shrink, *t_sweep = paired_us(
                [lambda w=w: kernels.nvfp4_mm(x, w) for w in wq],
                [lambda w=w, b=b: kernels.nvfp4_mm(x, w, lora=(xa, b)) for w, b in zip(wq, B)],
                [lambda a=a: x @ a.t() for a in A],
                [lambda a=a: x @ a for a in At],
                [lambda a=a: (a @ x.t()).t() for a in A],
                [lambda a=a: lora_shrink(x, a) for a in A],
                *[[lambda a=a, c=c: lora_shrink(x, a, c) for a in A] for c in SHRINK_SWEEP])
            sweep = {config_name(c): t for c, t in zip(SHRINK_SWEEP, t_sweep)}
            best = min(sweep, key=sweep.get)
            t_read = R * K * 2 / bw / 1e3                                   # bytes / (GB/s) in us
            share = (t_b - t_gemm + min(t_now, t_nn, t_rev, t_shrink, sweep[best])) / t_gemm
            row = dict(group=name, M=M, rank=rank, R=R, K=K, N=N, gemm_us=t_gemm,
                       gemm_lora_b_us=t_b, a_xAT_us=t_now, a_xAt_us=t_nn, a_AxT_us=t_rev,
                       a_shrink_us=t_shrink, a_shrink_configs_us=sweep, read_a_us=t_read,
                       lora_share_best_a=share,
                       lora_share_today=(t_b - t_gemm + t_now) / t_gemm)
            rows.append(row)
            print(f"{name:>8} {M:>3} {t_gemm:7.2f} {t_b:7.2f} {t_now:7.2f} {t_nn:7.2f} "
                  f"{t_rev:9.2f} {t_shrink:7.2f} {sweep[best]:7.2f} {best:>8} {t_read:7.2f} "
                  f"{100 * share:9.1f}%")
    out["lora"] = rows
    out["lora_norm"] = norm_rows(Ms, shapes, rank)
    return rows


@torch.no_grad()          # as in generation: rms_norm_lora runs its kernel without autograd only
def norm_rows(Ms, shapes, rank: int) -> list[dict]:
    """The RMSNorm (residual add included) before q/k/v and before gate/up, alone, followed by the
    group's A product (cuBLAS, lora_shrink), and with the A product in its own launch
    (rms_norm_lora, NANOQERL_LORA_NORM=1): microseconds a call, CUDA graphs as above."""
    from layers.ops import rms_norm
    from layers.shrink import lora_shrink, rms_norm_lora

    print(f"the norm before a fused group, and its A product (rank {rank}), microseconds a call")
    print(f"{'group':>8} {'M':>3} {'norm':>7} {'+xA^T':>7} {'+shrink':>8} {'fused':>7} "
          f"{'saved':>7}")
    rows = []
    for name in ("qkv", "gate_up"):
        H = shapes[name][1]
        R = rank * MEMBERS[name]
        A = [torch.randn(R, H, device="cuda", dtype=torch.bfloat16) * 0.02
             for _ in range(copies_for(R * H * 2))]
        w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        for M in Ms:
            d = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
            norm = lambda: rms_norm(d, w, 1e-6, None, h)[0]                # noqa: E731
            t_norm, t_cublas, t_shrink, t_fused = paired_us(
                [norm],
                [lambda a=a: norm() @ a.t() for a in A],
                [lambda a=a: lora_shrink(norm(), a) for a in A],
                [lambda a=a: rms_norm_lora(d, w, 1e-6, None, h, a) for a in A])
            saved = min(t_cublas, t_shrink) - t_fused
            rows.append(dict(group=name, M=M, R=R, H=H, norm_us=t_norm, norm_xAT_us=t_cublas,
                             norm_shrink_us=t_shrink, fused_us=t_fused, saved_us=saved))
            print(f"{name:>8} {M:>3} {t_norm:7.2f} {t_cublas:7.2f} {t_shrink:8.2f} "
                  f"{t_fused:7.2f} {saved:7.2f}")
    return rows


def rollout_paths(out: dict, size: str, batches, new_tokens: int, prompt: int, rank: int,
                  rounds: int, paths=tuple(PATHS)) -> list[dict]:
    """Tokens/s of the engine with the LoRA off and on each of PATHS (see the module docstring):
    a row per (batch, round, path) in out["rollout_paths"], and per batch the median tok/s and
    the median cost of each path (out["rollout_paths_summary"])."""
    import lora
    from bench.model_speed import add_random_lora, decode_bytes, time_engine
    from layers import shrink

    m = random_model(size, True)
    add_random_lora(m, rank)
    wb, rows, summary = decode_bytes(m), [], []
    saved = [getattr(shrink, k) for k in SWITCHES]
    try:
        for B in batches:
            for r in range(rounds):
                # odd rounds in reverse: a drift over a round (clocks, heat) favours no path
                order = list(paths) if r % 2 == 0 else list(paths)[::-1]
                for path in order:
                    on, *switches = PATHS[path]
                    for k, v in zip(SWITCHES, switches):
                        setattr(shrink, k, v)
                    # the switches are read at every call; a fresh engine captures its graphs
                    # with them
                    lora.set_enabled(m, on)
                    row = dict(size=size, rank=rank, batch=B, round=r, path=path,
                               **time_engine(m, B, prompt, new_tokens, wb, out))
                    torch.cuda.empty_cache()
                    rows.append(row)
            summary.append(path_summary(B, [x for x in rows if x["batch"] == B]))
    finally:
        for k, v in zip(SWITCHES, saved):
            setattr(shrink, k, v)
        lora.set_enabled(m, True)
    out["rollout_paths"], out["rollout_paths_summary"] = rows, summary
    return summary


def path_summary(B: int, rows: list[dict]) -> dict:
    """Per path: the median tok/s over rounds and the median of each round's cost against the same
    round's adapters-off run; printed as one line."""
    off = {x["round"]: x["tok_s"] for x in rows if x["path"] == "off"}
    res = dict(batch=B, rounds=len(off))
    line = f"batch {B:>3}: off {statistics.median(off.values()):8.1f} tok/s"
    for path in PATHS:
        mine = [x for x in rows if x["path"] == path]
        if path == "off" or not mine:
            continue
        cost = statistics.median(1 - x["tok_s"] / off[x["round"]] for x in mine)
        tok = statistics.median(x["tok_s"] for x in mine)
        res[path] = dict(tok_s=tok, cost=cost)
        line += f" | {path} {tok:8.1f}, cost {100 * cost:5.1f}%"
    print(line)
    return res
