"""bench_xf.py: kernels_ws's loader issuing each stage's token tile before its words and scales (XF) against the
dispatch's order (an experiment).   python bench_xf.py 64,96,128,256,512"""
import sys

import torch

import bench
import kernels_ws


def main():
    Ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "64,128,256").split(",")]
    for name, (N, K) in bench.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(bench.copies_for(N * K * 2))]
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cfg = kernels_ws.ws_config(M, N, K)
            if cfg is None:
                continue
            ref = kernels_ws.ws_mm(x, wq[0], config=cfg)
            assert torch.equal(kernels_ws.ws_mm(x, wq[0], config=dict(cfg, XF=True)), ref), (name, M)
            t = bench.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                [lambda w=w: kernels_ws.ws_mm(x, w, config=cfg) for w in wq],
                                [lambda w=w: kernels_ws.ws_mm(x, w, config=dict(cfg, XF=True)) for w in wq])
            print(f"| {name} | {M} | {cfg} | bf16 {t[0]:.1f} | words first {t[1]:.1f} | tokens first {t[2]:.1f} | "
                  f"{t[1] / t[2]:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
