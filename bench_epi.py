"""bench_epi.py (experiment): kernels_ws's 64-token tiles with the epilogue's layout conversion in token stage 0 (as
the 256-token tiles do) and rings of 4 or 5 stages, against the previous kernel (kernels_ws_old.py, 4 stages, the
conversion through a separate buffer). Same bits checked; CUDA graphs, weights rotated (bench.paired_us).

    python bench_epi.py 40,48,56,64
"""
import sys

import torch

import bench
import kernels_ws
import kernels_ws_old


def main():
    Ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "40,48,56,64").split(",")]
    print("| shape | tokens | LoRA | config | bf16 us | old, 4 stages | new, 4 stages | new, 5 stages |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (N, K) in bench.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(bench.copies_for(N * K * 2))]
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        for M in Ms:
            cfg = kernels_ws.ws_config(M, N, K)
            if cfg is None or cfg["BM"] != 64:
                continue
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            for rank in (0, 32):
                lora = None
                if rank:
                    xa = torch.randn(M, rank, device="cuda", dtype=torch.bfloat16)
                    lora = (xa, torch.randn(N, rank, device="cuda", dtype=torch.bfloat16) * 0.01)
                runs = [(kernels_ws_old, dict(cfg, S=4)), (kernels_ws, dict(cfg, S=4)), (kernels_ws, dict(cfg, S=5))]
                ref = kernels_ws_old.ws_mm(x, wq[0], config=runs[0][1], lora=lora)
                for mod, c in runs[1:]:
                    assert torch.equal(mod.ws_mm(x, wq[0], config=c, lora=lora), ref), (name, M, c)
                t = bench.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                    *[[lambda w=w, mod=mod, c=c: mod.ws_mm(x, w, config=c, lora=lora) for w in wq]
                                      for mod, c in runs])
                print(f"| {name} | {M} | {rank} | {cfg} | {t[0]:.1f} | " + " | ".join(f"{v:.1f}" for v in t[1:]) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
