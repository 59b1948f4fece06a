"""bench_ring2.py: kernels_ws's GEMM with the token tiles in a ring of their own (an experiment).

    python bench_ring2.py 64,128,256

SX > 0: the words and scales keep S stages, the tokens SX (S a multiple of SX), each ring with a loader warp of its
own; a word stage goes back to its loader as soon as its words are in registers. Against the dispatch (one ring,
S stages of words, scales and tokens), same bits asserted. Times: CUDA graphs, weights rotated (bench.paired_us).
"""
import sys

import torch

import bench
import kernels_ws

COMBOS = {64: [dict(S=8, SX=4), dict(S=8, SX=2), dict(S=6, SX=3), dict(S=6, SX=2)],
          128: [dict(S=6, SX=3), dict(S=6, SX=2), dict(S=4, SX=2)],
          256: [dict(S=4, SX=2)]}


def main():
    Ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "64,128,256").split(",")]
    for name, (N, K) in bench.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(bench.copies_for(N * K * 2))]
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cfg = kernels_ws.ws_config(M, N, K) or dict(BM=128, maxnreg=None)
            combos = [c for c in COMBOS[cfg["BM"]]]
            ref = kernels_ws.ws_mm(x, wq[0], config=cfg)
            for c in combos:
                assert torch.equal(kernels_ws.ws_mm(x, wq[0], config=dict(cfg, **c)), ref), (name, M, c)
            t = bench.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                [lambda w=w: kernels_ws.ws_mm(x, w, config=cfg) for w in wq],
                                *[[lambda w=w, c=c: kernels_ws.ws_mm(x, w, config=dict(cfg, **c)) for w in wq]
                                  for c in combos])
            print(f"| {name} | {M} | {cfg} | bf16 {t[0]:.1f} | dispatch {t[1]:.1f} | "
                  + " | ".join(f"S{c['S']}/SX{c['SX']} {v:.1f}" for c, v in zip(combos, t[2:])) + " |", flush=True)


if __name__ == "__main__":
    main()
