"""bench/common.py: what every benchmark shares: the linear shapes, CUDA-graph timing, random NVFP4
weights and random Qwen2.5-shaped models (no subcommand of its own; the others import it, never the
entry point).

Timing: CUDA graphs of many calls (launch gaps excluded), the median of several replays, the two
sides of a ratio replayed in turn (paired_us); weights rotate over enough copies that every call
reads them from HBM, not L2 (50 MB).
Needs a CUDA GPU.
"""
import math
import statistics

import torch

from gemm import layout

SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584),
             "down": (3584, 18944)}
SHAPES_32B = {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (55296, 5120),
              "down": (5120, 27648)}
L2_BYTES = 50 * 2**20


def graph_time_us(calls, reps: int = 5, replays: int = 7) -> float:
    """Median microseconds per call of `calls` (a list of closures), captured in one CUDA graph."""
    return paired_us(calls, reps=reps, replays=replays)[0]


def paired_us(*call_lists, reps: int = 5, replays: int = 7) -> list[float]:
    """Median microseconds per call of each list of closures, one CUDA graph per list, the graphs
    replayed in turn (a, b, a, b, ...): a compute-bound GEMM runs at the power limit, whose clock
    drifts as the GPU warms, so timing one side after the other would favour the first."""
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
    import quantize

    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, scale, gs = quantize.quantize_weight(w)
    base = layout.pack_nvfp4(packed, scale, gs.cuda())
    ws = [base] + [layout.NVFP4Weight(base.words.clone(), base.scales.clone(),
                                      base.global_scale.clone(), N, K)
                   for _ in range(copies - 1)]
    return w, ws



QWEN = {"7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                   tie_word_embeddings=False),
        "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                    num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                    tie_word_embeddings=False)}


def random_model(size: str, nvfp4: bool):
    """A Qwen2.5-shaped model.Model with random weights on the GPU (quantized layer by layer when
    nvfp4)."""
    import model as M
    import quantize

    cfg = M.config_from_hf(dict(architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6,
                                rope_theta=1e6, max_position_embeddings=32768,
                                eos_token_id=151645, **QWEN[size]))
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
            w = {n: torch.randn(lin.out_features, lin.in_features, device="cuda", generator=g)
                 .mul_(0.02).to(torch.bfloat16) for n, lin in lins.items()}
            for n, lin in lins.items():
                if lin.has_bias:
                    lin.bias = torch.zeros(lin.out_features, device="cuda", dtype=torch.bfloat16)
            if nvfp4:
                named = {f"model.layers.0.{n}.weight": t for n, t in w.items()}
                q, _ = quantize.quantize_state_dict(named, device="cuda")
                for n, lin in lins.items():
                    k = f"model.layers.0.{n}."
                    lin.words, lin.scales, lin.global_scale, *_ = layout.pack_nvfp4(
                        q[k + "weight_packed"].cuda(), q[k + "weight_scale"].cuda(),
                        q[k + "weight_global_scale"].cuda())
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
