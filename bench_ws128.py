"""bench_ws128.py: kernels_ws with a 128-row weight tile on two consumer warp groups, against the dispatch (H100).

    python bench_ws128.py [64,128,256]

The variant is kernels_ws's own source with its tile widened from 64 to 128 weight rows: the partition that
dequantizes and issues the wgmmas runs on 8 warps (two warp groups, 64 rows each, both reading the same token
stage), so each token tile serves twice the weights (half the token traffic through L2 per weight). With the loader's
warp that makes 12 warps, launched at 168 registers a thread; Triton's setmaxnreg then gives the two consumer warp
groups 232 each, and ptxas keeps up to 7 wgmmas in flight (printed: the SASS's deepest wgmma wait). Every config
is checked against the dispatch's output (fp32 tolerance) and timed in one CUDA-graph run. No 256-token tile
(its epilogue reuses a token stage sized for 64 rows)."""
import importlib.util
import inspect
import os
import sys
import tempfile

import torch

import bench
import kernels
import kernels_ws

_EDITS = [  # (old, new): 64 -> 128 weight rows a program, 4 -> 8 warps in the consumer partition
    ("warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16]",
     "warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 16]"),
    ("warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 2]",
     "warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 2]"),
    ("[64, 2], gl.SwizzledSharedLayout", "[128, 2], gl.SwizzledSharedLayout"),
    ("warps_per_cta=[4, 1]", "warps_per_cta=[8, 1]"),
    ("gl.zeros((64, BM)", "gl.zeros((128, BM)"),
    ("gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])", "gl.BlockedLayout([8, 1], [8, 4], [2, 4], [0, 1])"),
    ("gl.arange(0, 64, gl.SliceLayout(1, OUT))", "gl.arange(0, 128, gl.SliceLayout(1, OUT))"),
    ("gl.program_id(0) * 64,", "gl.program_id(0) * 128,"),
    ("[S, 64, 16], w_desc.layout", "[S, 128, 16], w_desc.layout"),
    ("[S, 32, 4], s_desc.layout", "[S, 64, 4], s_desc.layout"),
    ("gl.arange(0, 128, gl.BlockedLayout([1], [32], [4], [0]))",
     "gl.arange(0, 256, gl.BlockedLayout([1], [32], [8], [0]))"),
]


def variant():
    """The edited copy of kernels_ws, imported from a temporary file (Gluon compiles from the source text)."""
    src = inspect.getsource(kernels_ws)
    for old, new in _EDITS:
        assert old in src, old
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), "kernels_ws128.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("kernels_ws128", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ws128_mm(V, x2, w, BM, S, split):
    """(y = x2 @ W_hat^T, the compiled kernel) with the 128-row variant (kernels_ws.ws_mm's boxes and grid, widened)."""
    M, K = x2.shape
    KT, NP = w.words.shape[0], w.words.shape[1]
    wl = V.gl.NVMMASharedLayout.get_default_for([128, 16], V.gl.int32)
    sl = V.gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    xl = V.gl.NVMMASharedLayout.get_default_for([BM, 128], V.gl.bfloat16)
    w_desc = V.TensorDescriptor.from_tensor(w.words.view(KT * NP, 16), [128, 16], wl)
    s_desc = V.TensorDescriptor.from_tensor(w.scales.view(KT * NP // 2, 4), [64, 4], sl)
    x_desc = V.TensorDescriptor.from_tensor(x2, [BM, 128], xl)
    y = torch.empty(M, w.n, dtype=x2.dtype, device=x2.device)
    grid = (-(-w.n // 128), -(-M // BM), split)
    ws, cnt = kernels._workspace(x2.device, split * grid[1] * BM * w.n if split > 1 else 0, grid[0] * grid[1])
    k = V._ws_kernel[grid](w_desc, s_desc, x_desc, w.global_scale, y, y, ws, cnt, cnt, M, M, w.n, NP, KT // split,
                           y.stride(0), BM=BM, S=S, SPLIT=split, HAS_BIAS=False, num_warps=8)
    return y, k


def inflight(compiled) -> int:
    """The largest n of the SASS's `WARPGROUP.DEPBAR.LE gsb0, n` (0: ptxas serialized the wgmmas)."""
    import re
    import subprocess
    import triton
    path = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout
    return max(int(n, 16) for n in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))


def main():
    V = variant()
    Ms = [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64, 128, 256]
    for name, (N, K) in bench.SHAPES_7B.items():
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(bench.copies_for(N * K * 2))]
        _, wq = bench.random_nvfp4(N, K, bench.copies_for(N * K * 9 // 16))
        KT = -(-K // 128)
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = kernels.nvfp4_mm(x, wq[0]).float()
            cfgs = [(BM, S, split) for BM in ((64,) if M <= 64 else (64, 128)) for S in ((4, 5) if BM == 64 else (3, 4))
                    for split in range(1, 9) if KT % split == 0
                    and (split == 1 or -(-N // 128) * -(-M // BM) * split <= 2 * 132)]
            for c in cfgs:
                y, k = ws128_mm(V, x, wq[0], *c)
                d = (y.float() - ref).abs().max().item()
                assert d <= 0.02 * ref.abs().max().item(), (name, M, c, d)
            print(f"wgmmas in flight at most: {inflight(k)}", flush=True)
            t = bench.paired_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb],
                                [lambda w=w: kernels.nvfp4_mm(x, w) for w in wq],
                                *[[lambda w=w, c=c: ws128_mm(V, x, w, *c)[0] for w in wq] for c in cfgs])
            best = min(range(len(cfgs)), key=lambda i: t[2 + i])
            print(f"{name:7s} M={M:4d} bf16 {t[0]:6.1f} us | dispatch {t[1]:6.1f} ({t[0] / t[1]:.2f}x) | 128 rows, "
                  f"best (BM, S, split) {cfgs[best]}: {t[2 + best]:6.1f} ({t[0] / t[2 + best]:.2f}x) | all: "
                  + " ".join(f"{c}: {tc:.1f}" for c, tc in zip(cfgs, t[2:])), flush=True)


if __name__ == "__main__":
    main()
