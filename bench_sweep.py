"""bench_sweep.py: the candidate GEMM tile configs that `python bench.py kernels --sweep` times, and their compilation
in parallel processes (so the timing process finds every config cached). Imported by bench.py; needs a CUDA GPU.
"""
import json
import sys
import time

import torch

import bench


def sweep_configs(M, N, K, family: str = "all"):
    """Candidate tile configs for M tokens: token tile BM, weight-row tile BN, split-K, warps, pipeline depth.

    With 4 or 8 warps and BN >= 64 the dot runs on wgmma (Hopper warp-group MMA); with 1-2 warps, or BN < 64, Triton
    falls back to per-warp mma.sync, whose warps interleave dequant and MMA freely."""
    BMs = [16] if M <= 16 else [32] if M <= 32 else [64] if M <= 64 else [64, 128, 256]
    pairs = [(64, 4), (128, 4), (128, 8), (256, 4), (256, 8)] if family != "mma" else []  # (BN, warps): wgmma
    if M <= 64 and family != "wgmma":
        pairs += [(16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (32, 4)]                        # mma.sync
    out = []
    for BM in BMs:
        for BN, nw in pairs:
            if BN * BM > 128 * 32 * nw:                                          # over 128 accumulator registers
                continue
            for split in (1, 2, 4, 8, 16):
                if (K // 128) // split < 2 or -(-N // BN) * -(-M // BM) * split > 16 * 132:
                    continue
                for stages in ((2, 3, 4) if BM <= 64 else (2, 3)):
                    out.append(dict(BM=BM, BN=BN, SPLIT_K=split, num_warps=nw, num_stages=stages))
    return out


def _compile_worker(rank: int, jobs: int, Ms, family: str):
    """Compile (by running once) this worker's share of the sweep configs, so the timing process finds them cached."""
    import kernels

    keys = sorted({(M, json.dumps(c, sort_keys=True)) for N, K in bench.SHAPES_7B.values() for M in Ms
                   if M < kernels.LARGE_M for c in sweep_configs(M, N, K, family)})
    mine = {k for i, k in enumerate(keys) if i % jobs == rank}
    for N, K in bench.SHAPES_7B.values():
        KT, Np = -(-K // 128), -(-N // 128) * 128                        # the values do not matter for compiling
        w = kernels.NVFP4Weight(torch.zeros(KT, Np, 16, dtype=torch.int32, device="cuda"),
                                torch.zeros(KT, Np, 2, dtype=torch.int32, device="cuda"),
                                torch.ones(1, device="cuda"), N, K)
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            for c in sweep_configs(M, N, K, family):
                if (M, json.dumps(c, sort_keys=True)) in mine:
                    try:
                        kernels.nvfp4_mm(x, w, config=c)
                    except Exception:  # out of shared memory or registers: the timing pass skips it too
                        pass
    torch.cuda.synchronize()


def precompile(Ms, jobs: int, family: str):
    import torch.multiprocessing as mp

    t0 = time.time()
    mp.start_processes(_compile_worker, args=(jobs, Ms, family), nprocs=jobs, start_method="spawn")
    print(f"compiled the sweep configs in {time.time() - t0:.0f} s with {jobs} processes", file=sys.stderr)
