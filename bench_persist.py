# python bench_persist.py 64,96,128,192,256,384,512   (add "lora" as a second argument for LoRA of rank 32)
"""A/B: the warp-specialized GEMM with resident programs looping over tiles (persist) vs one program a tile."""
import sys
import torch
import bench, kernels, kernels_ws

Ms = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "64,128,192,256,384,512").split(",")]
lora = len(sys.argv) > 2
for name in ("gate_up", "down", "o", "qkv"):
    N, K = bench.SHAPES_7B[name]
    wb, ws = bench.random_nvfp4(N, K, bench.copies_for(N * K // 2))
    wbs = [wb.clone() for _ in range(bench.copies_for(N * K * 2))]
    for M in Ms:
        cfg = kernels_ws.ws_config(M, N, K)
        if cfg is None:
            continue
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        lo = None
        if lora:
            xa = torch.randn(M, 32, device="cuda", dtype=torch.bfloat16)
            lo = (xa, torch.randn(N, 32, device="cuda", dtype=torch.bfloat16) * 0.01)
        ref = kernels.nvfp4_linear_ref(x, ws[0]).float()
        if lo is not None:
            ref = ref + (lo[0].float() @ lo[1].float().t())
        on, off = dict(cfg, persist=True), dict(cfg, persist=False)
        P = -(-N // 64) * -(-M // cfg["BM"])
        sch = kernels_ws.schedule(P, -(-K // 128), cfg["BM"], cfg["maxnreg"], cfg.get("SPLIT", 1), 132)
        err = [((kernels_ws.ws_mm(x, ws[0], config=c, lora=lo).float() - ref).abs().max() / ref.abs().max()).item()
               for c in (on, off)]
        t_on, t_off, t_bf = bench.paired_us([lambda w=w: kernels_ws.ws_mm(x, w, config=on, lora=lo) for w in ws],
                                            [lambda w=w: kernels_ws.ws_mm(x, w, config=off, lora=lo) for w in ws],
                                            [lambda w=w: torch.nn.functional.linear(x, w) for w in wbs])
        print(f"{name:7s} M={M:4d} {cfg} schedule {sch}: persist {t_on:7.1f} us, one a tile {t_off:7.1f} us "
              f"({t_off / t_on:.3f}x), bf16 {t_bf:7.1f} us -> {t_bf / t_on:.2f}x vs {t_bf / t_off:.2f}x; "
              f"rel err {err[0]:.1e} / {err[1]:.1e}", flush=True)
