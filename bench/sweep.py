"""bench/sweep.py: the candidate GEMM tile configs that `python -m bench kernels --sweep` times, and
their compilation in parallel processes (so the timing process finds every config cached); the
ablation of the GEMM main loop that `python -m bench kernels --parts ablate` times; kernels_ws's
GEMM against the Triton one (`--parts ws`) and where its programs' time goes (`--parts stamps`); the
read floor of the GEMM table. Imported by bench/kernel_speed.py and the entry point; needs a CUDA
GPU.
"""
import json
import sys
import time

import torch
import triton
import triton.language as tl

from bench import common
from gemm import layout
from gemm.configs import mm_config, split_k
from kernels import _dequant_regs


def sweep_configs(M, N, K, family: str = "all"):
    """Candidate tile configs for M tokens: token tile BM, weight-row tile BN, split-K, warps,
    pipeline depth, and (above 16 tokens) the first K tile peeled out of the loop or not.

    With 4 or 8 warps and BN >= 64 the dot runs on wgmma (Hopper warp-group MMA); with 1-2 warps, or
    BN < 64, Triton falls back to per-warp mma.sync, whose warps interleave dequant and MMA
    freely."""
    if family == "ks":
        return ks_configs(M, N, K)
    BMs = [16] if M <= 16 else [32] if M <= 32 else [64] if M <= 64 else [64, 128, 256]
    # (BN, warps): wgmma
    pairs = [(64, 4), (128, 4), (128, 8), (256, 4), (256, 8)] if family != "mma" else []
    if M <= 64 and family != "wgmma":
        pairs += [(16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (32, 4)]  # mma.sync
    out = []
    for BM in BMs:
        for BN, nw in pairs:
            if BN * BM > 128 * 32 * nw:  # over 128 accumulator registers
                continue
            for split in (1, 2, 4, 8, 16):
                if (K // 128) // split < 2 or -(-N // BN) * -(-M // BM) * split > 16 * 132:
                    continue
                for stages in (2, 3, 4):
                    for peel in ((0, 1) if M > 16 else (0,)):
                        out.append(dict(BM=BM, BN=BN, SPLIT_K=split, num_warps=nw,
                                        num_stages=stages, PEEL=peel))
    return out


def ks_configs(M, N, K):
    """Configs of the K-sliced kernel (KS slices of K per program, summed at the end: no split-K
    workspace): token tile BM = M rounded up to a power of two (up to 64), 16-128 weight rows, 2-8
    slices on as many warps (or 8 warps for 4 slices: 2 warps along the rows), 2-8 stages, where the
    ring's buffers fit in 200 KB of shared memory and the dequantized tile and accumulators in about
    160 registers a thread; and first, for comparison, the split-K config the dispatch would take
    without the K-sliced kernel."""

    BM = 1 << (M - 1).bit_length()
    if BM > 64:
        return []
    out = [mm_config(M, N, K, sliced=False)]
    for BN in (16, 32, 64, 128):
        for KS, nw in ((2, 2), (4, 4), (4, 8), (8, 8)):
            regs = KS * BN * (64 + BM) / (32 * nw)  # bf16 tile (2 a register) + fp32 accumulators
            for st in (2, 3, 4, 5, 6, 8):
                if (regs <= 160 and (st - 1) * KS * (BN * 72 + 256 * BM) <= 200 * 1024
                        and (BN <= 32 or st in (3, 4, 6))):
                    out.append(dict(BM=BM, BN=BN, KS=KS, num_warps=nw, num_stages=st))
    return out


def _compile_worker(rank: int, jobs: int, Ms, family: str, shapes: dict):
    """Compile (by running once) this worker's share of the sweep configs, so the timing process
    finds them cached."""
    import kernels

    keys = sorted({(M, json.dumps(c, sort_keys=True)) for N, K in shapes.values() for M in Ms
                   if M < kernels.LARGE_M for c in sweep_configs(M, N, K, family)})
    mine = {k for i, k in enumerate(keys) if i % jobs == rank}
    for N, K in shapes.values():
        KT, Np = -(-K // 128), -(-N // 128) * 128  # the values do not matter for compiling
        w = layout.NVFP4Weight(torch.zeros(KT, Np, 16, dtype=torch.int32, device="cuda"),
                                torch.zeros(KT, Np, 2, dtype=torch.int32, device="cuda"),
                                torch.ones(1, device="cuda"), N, K)
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            for c in sweep_configs(M, N, K, family):
                if (M, json.dumps(c, sort_keys=True)) in mine:
                    try:
                        kernels.nvfp4_mm(x, w, config=c)
                    except Exception:
                        # out of shared memory or registers: the timing pass skips it too
                        pass
    torch.cuda.synchronize()


def precompile(Ms, jobs: int, family: str, shapes: dict):
    import torch.multiprocessing as mp

    t0 = time.time()
    mp.start_processes(_compile_worker, args=(jobs, Ms, family, shapes), nprocs=jobs,
                       start_method="spawn")
    print(f"compiled the sweep configs in {time.time() - t0:.0f} s with {jobs} processes",
          file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# Read floor: the time to stream an NVFP4 weight's bytes and do nothing with them


@triton.jit
def _read_kernel(w_ptr, s_ptr, out_ptr, NW, NS, PER_W, PER_S, BLOCK: tl.constexpr):
    # program p XORs words [p * PER_W, (p + 1) * PER_W) and scale words likewise; one int out, so
    # nothing is elided
    p = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in tl.range(0, PER_W, BLOCK):
        o = p * PER_W + i + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + o, mask=o < NW, other=0)
    for i in tl.range(0, PER_S, BLOCK):
        o = p * PER_S + i + tl.arange(0, BLOCK)
        acc ^= tl.load(s_ptr + o, mask=o < NS, other=0)
    tl.store(out_ptr + p, tl.sum(acc))


def read_floor_us(wq) -> float:
    """Microseconds to read one NVFP4 weight's words and scales from HBM (rotating over the copies
    wq), the fastest of a few grid sizes and pipeline depths (`python -m bench kernels`' "read
    floor": an estimate; the K-sliced GEMM has read gate_up faster than this kernel did,
    KERNELS.md)."""
    NW, NS = wq[0].words.numel(), wq[0].scales.numel()
    best = float("inf")
    for P, BLOCK, stages in ((1056, 1024, 3), (1056, 1024, 4), (2112, 2048, 3), (2112, 2048, 4)):
        out = torch.empty(P, dtype=torch.int32, device="cuda")
        pw, ps = -(-NW // P // BLOCK) * BLOCK, -(-NS // P // BLOCK) * BLOCK
        best = min(best, common.graph_time_us(
            [lambda w=w: _read_kernel[(P,)](w.words, w.scales, out, NW, NS, pw, ps, BLOCK=BLOCK,
                                            num_warps=8, num_stages=stages)
             for w in wq], reps=3))
    return best


# --------------------------------------------------------------------------------------------------
# Ablation: the GEMM with one stage changed, to see what bounds it at M = 16 / 64


@triton.jit
def _ablate_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, NP, K, KT,
                   TILES_PER_SPLIT, stride_xm,
                   BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr, MODE: tl.constexpr,
                   PEEL: tl.constexpr):
    # kernels._nvfp4_mm_kernel without bias or LoRA. MODE 0: as it is (the same numbers); 1: the
    # first token tile reused for every K tile (no token traffic in the loop); 2: tokens read with
    # 8-byte copies that may stay in L1 (cp.async.ca), so the blocks on one SM could share them; 3:
    # split-K partials parked, no fixup (1-3: wrong results)
    pid_n, pid_k = tl.program_id(0), tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    kk = tl.arange(0, 128)
    if MODE == 2:
        # contiguity 4: the compiler issues 8-byte copies, cached in L1
        kk = (kk // 4) * 4 + kk % 4
    t0 = pid_k * TILES_PER_SPLIT
    wp = w_ptr + (t0 * NP + n[:, None]) * 16 + tl.arange(0, 16)[None, :]
    sp = s_ptr + (t0 * NP + n[:, None]) * 2 + tl.arange(0, 2)[None, :]
    xp = x_ptr + m[:, None] * stride_xm + t0 * 128 + kk[None, :]
    x0 = tl.load(xp, mask=m[:, None] < M, other=0.0)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if PEEL:
        sw0, sw1 = tl.split(tl.load(sp))
        xt = x0 if MODE == 1 else tl.load(xp, mask=(m[:, None] < M) & (t0 * 128 + kk[None, :] < K),
                                          other=0.0)
        acc = tl.dot(_dequant_regs(tl.load(wp), sw0, sw1, BN, True), tl.trans(xt), acc)
        wp += NP * 16
        sp += NP * 2
        xp += 128
    for t in tl.range(t0 + PEEL, tl.minimum(t0 + TILES_PER_SPLIT, KT)):
        words = tl.load(wp)
        sw0, sw1 = tl.split(tl.load(sp))
        xt = x0 if MODE == 1 else tl.load(xp, mask=(m[:, None] < M) & (t * 128 + kk[None, :] < K),
                                          other=0.0)
        acc = tl.dot(_dequant_regs(words, sw0, sw1, BN, True), tl.trans(xt), acc)
        wp += NP * 16
        sp += NP * 2
        xp += 128
    acc = acc * (2.0 ** 119 / tl.load(gs_ptr))
    out_mask = (n[:, None] < N) & (m[None, :] < M)
    if SPLIT_K > 1:
        tl.store(ws_ptr + (pid_k * BM + m[None, :]) * N + n[:, None], acc, mask=out_mask)
        if MODE != 3:
            # the fixup of kernels.py: count the parked partials, the last program sums them
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                acc = tl.zeros((BN, BM), dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    acc += tl.load(ws_ptr + (s * BM + m[None, :]) * N + n[:, None], mask=out_mask,
                                   other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + m[None, :] * N + n[:, None], acc.to(tl.bfloat16), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")
    else:
        tl.store(y_ptr + m[None, :] * N + n[:, None], acc.to(tl.bfloat16), mask=out_mask)


def ablate(out: dict):
    """python -m bench kernels --parts ablate: gate_up (no split) and qkv (split in K) at M = 16 and
    64, with the dispatch table's configs, each variant against bf16 F.linear in the same run."""
    import kernels

    rows = []
    for name in ("gate_up", "qkv"):
        N, K = common.SHAPES_7B[name]
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
              for _ in range(common.copies_for(N * K * 2))]
        _, wq = common.random_nvfp4(N, K, common.copies_for(N * K * 9 // 16))
        for M in (16, 64):
            cfg = mm_config(M, N, K)
            KT = wq[0].words.shape[0]
            split, per = split_k(KT, cfg["SPLIT_K"])
            ws = torch.empty(split * cfg["BM"] * N, dtype=torch.float32, device="cuda")
            cnt = torch.zeros(-(-N // cfg["BN"]), dtype=torch.int32, device="cuda")

            def run(x, w, mode):
                y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
                _ablate_kernel[(-(-N // cfg["BN"]), 1, split)](
                    x, w.words, w.scales, w.global_scale, y, ws, cnt, M, N, w.words.shape[1], K, KT,
                    per, x.stride(0),
                    BM=cfg["BM"], BN=cfg["BN"], SPLIT_K=split, MODE=mode, PEEL=cfg["PEEL"],
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
                return y

            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(run(x, wq[0], 0), kernels.nvfp4_mm(x, wq[0])), (
                "mode 0 must be the real kernel")
            t_bf = common.graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb])
            modes = ((None, "kernels.nvfp4_mm itself"), (0, "as in kernels.py"),
                     (1, "no token traffic in the loop"), (2, "tokens via L1 (8-byte .ca)"))
            for mode, what in modes + (((3, "partials parked, no fixup"),) if split > 1 else ()):
                f = ((lambda w: kernels.nvfp4_mm(x, w)) if mode is None
                     else (lambda w, mode=mode: run(x, w, mode)))
                t = common.graph_time_us([lambda w=w, f=f: f(w) for w in wq])
                rows.append(dict(shape=name, M=M, split=split, variant=what, us=t,
                                 speedup=t_bf / t))
                print(f"{name:7s} M={M:3d} split {split:2d}  {what:30s} {t:7.1f} us  "
                      f"{t_bf / t:.2f}x bf16 ({t_bf:.1f} us)", flush=True)
    out["ablate"] = rows


def splits(out: dict):
    """python -m bench kernels --parts splits: every split-K count (not only the sweep's powers of
    two) per shape at M = 1 / 16 / 64, with the dispatch table's split-K tile (at M = 1 the dispatch
    runs the K-sliced kernel); prints the dispatch table's choice against the fastest."""
    import kernels

    rows = []
    for name, (N, K) in common.SHAPES_7B.items():
        _, wq = common.random_nvfp4(N, K, common.copies_for(N * K * 9 // 16))
        KT = -(-K // 128)
        for M in (1, 16, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            base = mm_config(M, N, K, sliced=False)  # the split-K tile, also at M <= 8
            ref = kernels.nvfp4_mm(x, wq[0])
            # what nvfp4_mm runs
            effective = sorted({split_k(KT, s)[0] for s in range(1, 17) if KT // s >= 2})
            times = {}
            for s in effective:
                c = dict(base, SPLIT_K=s)
                torch.testing.assert_close(kernels.nvfp4_mm(x, wq[0], config=c), ref,
                                           rtol=0.02, atol=0.07)
                times[s] = common.graph_time_us([lambda w=w, c=c: kernels.nvfp4_mm(x, w, config=c)
                                                 for w in wq])
            chosen = split_k(KT, base["SPLIT_K"])[0]
            best = min(times, key=times.get)
            rows.append(dict(shape=name, M=M, chosen=chosen, best=best, us=times))
            print(f"{name:7s} M={M:3d} dispatch split {chosen:2d}: {times[chosen]:6.1f} us | "
                  f"fastest {best:2d}: {times[best]:6.1f} us | "
                  + " ".join(f"{s}:{t:.1f}" for s, t in times.items()), flush=True)
    out["splits"] = rows


def ws_alternatives(M, N, K, sms=132):
    """The warp-specialized configs `--parts ws` times at M tokens: 64-token tiles (128 registers,
    two programs an SM) up to 256 tokens, 128-token tiles (255 registers) above 64, 256-token tiles
    above 192, each unsplit and split K ways for every K dividing the K tiles (up to 8) that keeps
    <= 4 programs per SM; split 64-token tiles also with a 3-stage ring (61.5 KB of shared memory:
    three programs an SM instead of two)."""
    KT = -(-K // 128)
    out = []
    for BM in ((64,) if M <= 64
               else (64, 128) if M <= 192
               else (64, 128, 256) if M <= 256
               else (128, 256)):
        tiles = -(-N // 64) * -(-M // BM)
        for split in range(1, 9):
            if KT % split == 0 and (split == 1 or tiles * split <= 4 * sms):
                out.append(dict(BM=BM, maxnreg=128 if BM == 64 else None, SPLIT=split))
                if BM == 64 and split > 1:
                    out.append(dict(BM=BM, maxnreg=128, SPLIT=split, S=3))
    return out


def ws(out: dict, Ms=(32, 48, 64, 96, 128, 160, 192, 224, 256, 384, 512, 768)):
    """python -m bench kernels --parts ws: kernels_ws's warp-specialized GEMM (each token tile,
    register budget and K split) against kernels.py's Triton GEMM (its mm_config) and bf16 F.linear,
    per 7B shape and token count, in one run, with the choice kernels.nvfp4_mm makes
    (kernels_ws.ws_config)."""
    import kernels
    from gemm import warp_specialized as kernels_ws

    rows = []
    name_of = lambda c: (f"{c['BM']}/{c['maxnreg']}/k{c.get('SPLIT', 1)}"  # noqa: E731
                         + (f"/s{c['S']}" if "S" in c else ""))
    for name, (N, K) in common.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
              for _ in range(common.copies_for(N * K * 2))]
        _, wq = common.random_nvfp4(N, K, common.copies_for(N * K * 9 // 16))
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            tri = mm_config(M, N, K)
            base = kernels_ws.ws_config(M, N, K)
            alts = ws_alternatives(M, N, K)
            if base is not None and base not in alts:
                alts.append(base)
            ref = kernels.nvfp4_mm(x, wq[0], config=tri).float()
            for c in alts:
                d = (kernels_ws.ws_mm(x, wq[0], config=c).float() - ref).abs().max().item()
                # another summation order only
                assert d <= 0.02 * ref.abs().max().item(), (name, M, c, d)
            t = common.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                [lambda w=w: kernels.nvfp4_mm(x, w, config=tri) for w in wq],
                                *[[lambda w=w, c=c: kernels_ws.ws_mm(x, w, config=c) for w in wq]
                                  for c in alts])
            best = min(range(len(alts)), key=lambda i: t[2 + i])
            rows.append(dict(shape=name, M=M, bf16_us=t[0], triton_us=t[1], ws_cfg=base,
                             ws_us={name_of(c): tc for c, tc in zip(alts, t[2:])},
                             dispatch_us=t[1] if base is None else t[2 + alts.index(base)]))
            print(f"{name:7s} M={M:4d} bf16 {t[0]:6.1f} us | "
                  f"triton {t[1]:6.1f} ({t[0] / t[1]:.2f}x) | ws "
                  + " ".join(f"{name_of(c)}: {tc:6.1f} ({t[0] / tc:.2f}x)"
                             for c, tc in zip(alts, t[2:]))
                  + f" | best {name_of(alts[best])}, dispatch: "
                  + ("triton" if base is None else name_of(base)),
                  flush=True)
    out["ws"] = rows


def stamps(out: dict):
    """python -m bench kernels --parts stamps: where a warp-specialized program's time goes, from
    the global timer read by each program at its start, when its first tile has landed, after its K
    loop and after its store (the split-K fixup included): medians over the programs of one call (L2
    flushed before it), for the M = 64 shapes qkv at 256 tokens (two waves of 128-token programs, or
    one of 256-token ones) and o at 512 tokens."""
    from gemm import warp_specialized as kernels_ws

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for name, M, cfg in [("o", 64, dict(BM=64, maxnreg=128)),
                         ("o", 64, dict(BM=64, maxnreg=128, SPLIT=2)),
                         ("o", 64, dict(BM=64, maxnreg=128, SPLIT=7)),
                         ("qkv", 64, dict(BM=64, maxnreg=128)),
                         ("qkv", 64, dict(BM=64, maxnreg=128, SPLIT=2)),
                         ("gate_up", 64, dict(BM=64, maxnreg=128)),
                         ("qkv", 256, dict(BM=128, maxnreg=None)),
                         ("qkv", 256, dict(BM=256, maxnreg=None)),
                         ("o", 512, dict(BM=256, maxnreg=None))]:
        N, K = common.SHAPES_7B[name]
        _, (w,) = common.random_nvfp4(N, K, 1)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        programs = -(-N // kernels_ws.BN) * -(-M // cfg["BM"]) * cfg.get("SPLIT", 1)
        st = torch.zeros(programs, 4, dtype=torch.int64, device="cuda")
        for _ in range(3):  # compile, warm up, then the call that is read
            flush.zero_()
            torch.cuda.synchronize()
            kernels_ws.ws_mm(x, w, config=cfg, stamps=st)
        torch.cuda.synchronize()
        t = (st - st[:, 0].min()).double().cpu() / 1e3  # (programs, 4) us
        med = lambda v: v.median().item()               # noqa: E731
        tiles = -(-K // 128) // cfg.get("SPLIT", 1)     # K tiles a program
        row = dict(shape=name, M=M, cfg=cfg, programs=programs, span_us=t[:, 3].max().item(),
                   late_start_us=t[:, 0].max().item(), first_tile_us=med(t[:, 1] - t[:, 0]),
                   loop_us=med(t[:, 2] - t[:, 1]), per_k_tile_us=med(t[:, 2] - t[:, 1]) / tiles,
                   epilogue_us=med(t[:, 3] - t[:, 2]),
                   epilogue_max_us=(t[:, 3] - t[:, 2]).max().item())
        rows.append(row)
        print(f"{name:7s} M={M:3d} {cfg}: {programs} programs, span {row['span_us']:.1f} us "
              f"(last start {row['late_start_us']:.1f}) | "
              f"medians: first tile {row['first_tile_us']:.2f}, "
              f"K loop {row['loop_us']:.2f} ({row['per_k_tile_us']:.3f} per K tile), "
              f"store / split-K fixup {row['epilogue_us']:.2f} "
              f"(max {row['epilogue_max_us']:.2f}) us", flush=True)
    out["stamps"] = rows


# --------------------------------------------------------------------------------------------------
# The rollout's sampler


def sampler(out: dict):
    """python -m bench kernels --parts sampler: sampler.race_sample over Qwen's 152064 logits at the
    rollout's batch sizes, its default chunks of a row against one chunk a row (one program a row:
    the sampler before the chunks), in one run; logits and noise stay in L2 between calls, as the
    logits do after the lm_head that writes them."""
    from layers.sampler import race_sample

    rows = []
    for B in (1, 16, 64, 256):
        z = torch.randn(B, 152064, device="cuda")
        e = torch.empty_like(z).exponential_()
        t = common.paired_us([lambda: race_sample(z, e, 1.0)],
                             [lambda: race_sample(z, e, 1.0, chunks=1)])
        rows.append(dict(batch=B, chunked_us=t[0], one_chunk_us=t[1]))
        print(f"sampler batch {B:3d}: chunked {t[0]:6.1f} us, "
              f"one program a row {t[1]:6.1f} us ({t[1] / t[0]:.1f}x)")
    out["sampler"] = rows


def attn(out: dict):
    """python -m bench kernels --parts attn: attention.decode_attention against torch SDPA as
    model.py called it (additive mask, enable_gqa) for one decode step's layer, 7B (28 / 4 heads)
    and 32B (40 / 8) at the rollout's batch sizes and KV lengths; KV caches rotate over enough
    copies that every call reads from HBM. Also the KV bytes per call over the time, against the
    copy bandwidth; and the kernel as a decode step calls it (new=)."""
    from layers import attention

    copy = common.copy_bandwidth()
    rows = []
    for size, HQ, HK in (("7b", 28, 4), ("32b", 40, 8)):
        for B in (1, 4, 16, 64, 256):
            for kv in (256, 512, 768):
                if size == "32b" and B == 256:
                    continue
                D, nbytes = 128, 2 * B * HK * kv * 128 * 2
                n = common.copies_for(nbytes)
                caches = [(torch.randn(B, HK, 768, D, device="cuda", dtype=torch.bfloat16),
                           torch.randn(B, HK, 768, D, device="cuda", dtype=torch.bfloat16))
                          for _ in range(n)]
                q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
                valid = torch.ones(B, 768, dtype=torch.bool, device="cuda")
                valid[:, : 768 - kv // 2 - 1: 7] = False  # some padding
                valid = valid[:, :kv]
                add = torch.zeros(B, 1, 1, kv, device="cuda", dtype=torch.bfloat16).masked_fill_(
                    ~valid[:, None, None], float("-inf"))
                sd = [lambda c=c: torch.nn.functional.scaled_dot_product_attention(
                          q, c[0][:, :, :kv], c[1][:, :, :kv], attn_mask=add, scale=D ** -0.5,
                          enable_gqa=True)
                      for c in caches]
                ours = [lambda c=c: attention.decode_attention(q, c[0][:, :, :kv], c[1][:, :, :kv],
                                                               valid, D ** -0.5)
                        for c in caches]
                # as a decode step calls it: RoPE on q and the new key, the new key and value
                # written at slot kv - 1 (the last: the keys it reads, bounded by the slot, are
                # all kv)
                # (any cos, sin)
                kn, vn, cos, sin = torch.randn(4, B, HK, D, device="cuda", dtype=torch.bfloat16)
                new = (kn, vn, cos[:, 0], sin[:, 0], torch.tensor([kv - 1], device="cuda"))
                step = [lambda c=c: attention.decode_attention(q, c[0][:, :, :kv], c[1][:, :, :kv],
                                                               valid, D ** -0.5, new=new)
                        for c in caches]
                with torch.no_grad():
                    err = (ours[0]().float() - sd[0]().float()).abs().max().item()
                    t_sd, t_ours, t_step = common.paired_us(sd, ours, step)
                row = dict(size=size, batch=B, kv=kv, sdpa_us=t_sd, ours_us=t_ours,
                           speedup=t_sd / t_ours, ours_GBps=nbytes / t_ours / 1e3,
                           sdpa_GBps=nbytes / t_sd / 1e3, max_abs_diff=err, step_us=t_step)
                if size == "7b":   # the kernel's knobs around attention.config_for's choice
                    c0 = attention.config_for(B * HK, kv)["chunks"]
                    var = [dict(chunks=c, block=bk, warps=w, stages=st)
                           for c in sorted({1, c0, 2 * c0})
                           for bk in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
                    with torch.no_grad():
                        ts = common.paired_us(*[
                            [lambda c=c, v_=v_: attention.decode_attention(
                                q, c[0][:, :, :kv], c[1][:, :, :kv], valid, D ** -0.5, v_)
                             for c in caches]
                            for v_ in var])
                    best = min(range(len(var)), key=ts.__getitem__)
                    row["best_variant"], row["best_us"] = var[best], ts[best]
                    print(f"  variants: best {var[best]} {ts[best]:.1f} us; next: "
                          + ", ".join(f"{tuple(v_.values())}: {t:.1f}"
                                      for v_, t in sorted(zip(var, ts), key=lambda z: z[1])[1:6]))
                rows.append(row)
                print(f"decode attention {size} batch {B:3d} kv {kv}: "
                      f"SDPA {t_sd:7.1f} us, ours {t_ours:7.1f} us ({t_sd / t_ours:.2f}x); "
                      f"{row['ours_GBps']:.0f} vs {row['sdpa_GBps']:.0f} GB/s (copy {copy:.0f}); "
                      f"max |diff| {err:.4f}; "
                      f"as a decode step (+ RoPE, cache write) {t_step:.1f} us")
                del caches
    out["decode_attention"] = rows
