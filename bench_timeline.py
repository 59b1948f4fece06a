# python bench_timeline.py
"""Timeline of warp-specialized GEMM programs (global-timer stamps): how many programs run over time."""
import sys, torch
import bench, kernels_ws

flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for name, M, cfg in [("gate_up", 64, dict(BM=64, maxnreg=128, persist=False)), ("gate_up", 64, dict(BM=64, maxnreg=128)),
                     ("gate_up", 128, dict(BM=128, maxnreg=None)), ("gate_up", 128, dict(BM=128, maxnreg=None, persist=False))]:
    N, K = bench.SHAPES_7B[name]
    _, (w,) = bench.random_nvfp4(N, K, 1)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    P = kernels_ws.schedule(-(-N // 64) * -(-M // cfg["BM"]), -(-K // 128), cfg["BM"], cfg["maxnreg"], 1, 132, cfg.get("persist", True))[0]
    st = torch.zeros(P, 4, dtype=torch.int64, device="cuda")
    for _ in range(3):
        flush.zero_(); torch.cuda.synchronize()
        kernels_ws.ws_mm(x, w, config=cfg, stamps=st)
    torch.cuda.synchronize()
    t = (st - st[:, 0].min()).double().cpu() / 1e3
    s, e = t[:, 0], t[:, 3]
    span = e.max().item()
    per = ((t[:, 2] - t[:, 1]) / (-(-K // 128) // cfg.get("SPLIT", 1)))
    print("   end of loop quantiles", " ".join(f"{q:.1f}" for q in t[:, 2].quantile(torch.tensor([0.1, .5, .9, 1.0], dtype=torch.float64)).tolist()))
    print(f"{name} M={M} {cfg} programs {P} span {span:.1f} us; start quantiles "
          + " ".join(f"{q:.1f}" for q in s.quantile(torch.tensor([0.25, .5, .75, .9, 1.0], dtype=torch.float64)).tolist())
          + " | end quantiles " + " ".join(f"{q:.1f}" for q in e.quantile(torch.tensor([0.1, .25, .5, .75, .9, 1.0], dtype=torch.float64)).tolist()))
    bins = torch.arange(0, span + 2, 2.0)
    run = [int(((s <= b) & (e > b)).sum()) for b in bins.tolist()]
    print("   running every 2 us:", run)
    order = s.argsort()
    late = order[-64:]
    print(f"   per K tile: first 264 programs {per[order[:264]].median():.3f}, last 64 {per[late].median():.3f} us;"
          f" last 64 start {s[late].min():.1f}-{s[late].max():.1f} end max {e[late].max():.1f}")
