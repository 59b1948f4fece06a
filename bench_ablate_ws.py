"""bench_ablate_ws.py: kernels_ws's GEMM with its consumer's work cut down, to see what limits it (an experiment).

    python bench_ablate_ws.py 64,128,256         # ABL 0..3
    python bench_ablate_ws.py 64,128 loads       # ABL 3 with the loader's copies cut (LAB)
    python bench_ablate_ws.py 64,128,256 pf      # the dispatch with its words prefetched into L2 PF tiles ahead
    python bench_ablate_ws.py 64,128,256 wide    # words as 256-byte TMA rows, scales as one 512-byte row (WIDE)
    python bench_ablate_ws.py 64 deep            # ABL 3, words (and scales) only, rings of 4 / 8 / 12 stages
    python bench_ablate_ws.py 64 stages          # the dispatch with rings of 4 / 5 / 8 stages (fewer programs an SM)

ABL 0 is the kernel as dispatched; 1 skips the dequantization (the words go to the wgmma as bf16 bits); 2 keeps
the dequantization but issues one wgmma a K tile (of the 8 blocks' sum) instead of 8; 3 does neither (raw words,
one wgmma). Same loads, ring and epilogue in all four. With `loads`: ABL 3, and the loader skips the scales'
copy (LAB bit 1), the words' (2) or the tokens' (4); the ring and its mbarriers stay. Times: CUDA graphs, weights rotated (bench.paired_us).
"""
import sys

import torch

import bench
import kernels_ws


def main():
    Ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "64,128,256").split(",")]
    mode = sys.argv[2] if len(sys.argv) > 2 else "abl"
    combos = ([dict(ABL=3, LAB=lab) for lab in (0, 1, 2, 4, 6, 5, 3)] if mode == "loads" else
              [dict(PF=pf) for pf in (0, 2, 4, 8, 16)] + [dict(PF=8, S=5)] if mode == "pf" else
              [dict(WIDE=w, **c) for c in ({}, dict(ABL=3, LAB=4), dict(ABL=3, LAB=5)) for w in (0, 1)]
              if mode == "wide" else
              [dict(ABL=3, LAB=lab, S=st, maxnreg=168) for lab in (5, 4) for st in (4, 8, 12)] if mode == "deep" else
              [dict(S=st) for st in (4, 5, 8)] if mode == "stages" else
              [dict(ABL=a) for a in range(4)])
    print("| shape | tokens | config | bf16 us | " + " | ".join(str(c) for c in combos) + " |")
    print("|---" * (4 + len(combos)) + "|")
    for name, (N, K) in bench.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(bench.copies_for(N * K * 2))]
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cfg = kernels_ws.ws_config(M, N, K) or dict(BM=128, maxnreg=None)
            if mode in ("pf", "wide", "stages"):  # the prefetch and the wide rows change no bits
                ref = kernels_ws.ws_mm(x, wq[0], config=cfg)
                for c in combos:
                    if (cfg["BM"] < 256 or c.get("S", 3) <= 3) and (cfg["BM"] < 128 or c.get("S", 4) <= 5) and "ABL" not in c:
                        assert torch.equal(kernels_ws.ws_mm(x, wq[0], config=dict(cfg, **c)), ref), (name, M, c)
            t = bench.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                *[[lambda w=w, c=c: kernels_ws.ws_mm(x, w, config=dict(cfg, **c)) for w in wq]
                                  for c in combos if (cfg["BM"] < 256 or c.get("S", 3) <= 3)
                                  and (cfg["BM"] < 128 or c.get("S", 4) <= 5)])
            print(f"| {name} | {M} | {cfg} | {t[0]:.1f} | " + " | ".join(f"{v:.1f}" for v in t[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
