"""bench_s6.py: 128-token tiles with a 6-stage ring (the epilogue's layout conversion in token stage 0) against the
dispatch's 5 (an experiment).   python bench_s6.py 96,128,160,192,256,384,512,768"""
import sys

import torch

import bench
import kernels_ws


def main():
    Ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "128,256").split(",")]
    for name, (N, K) in bench.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(bench.copies_for(N * K * 2))]
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cfg = kernels_ws.ws_config(M, N, K)
            if cfg is None or cfg["BM"] != 128:
                continue
            ref = kernels_ws.ws_mm(x, wq[0], config=cfg)
            assert torch.equal(kernels_ws.ws_mm(x, wq[0], config=dict(cfg, S=6)), ref), (name, M)
            t = bench.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                [lambda w=w: kernels_ws.ws_mm(x, w, config=cfg) for w in wq],
                                [lambda w=w: kernels_ws.ws_mm(x, w, config=dict(cfg, S=6)) for w in wq])
            print(f"| {name} | {M} | {cfg} | bf16 {t[0]:.1f} | S5 {t[1]:.1f} | S6 {t[2]:.1f} | {t[1] / t[2]:.3f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
