"""bench_wgmma.py: how fast one warp group's wgmmas run on their own, by token count N (the wgmma's N), with the A
operand (the weights) in registers (RS, as kernels_ws does) or in shared memory (SS), one or two programs an SM.

    python bench_wgmma.py                 # cycles a wgmma m64nNk16, N = 16 .. 256, RS / SS, 1 / 2 programs an SM

Each program issues ITERS x 8 wgmmas of m64nNk16 (bf16 in, fp32 accumulate), up to 7 in flight as in kernels_ws,
from operands that stay in place (no loads, no dequantization), and reads the SM clock before and after. It prints
the median cycles per wgmma over the programs and the multiply-adds an SM retires per cycle (the H100's dense bf16
peak is 2048 a cycle per SM: 989 TFLOPS at 1.83 GHz, 4 tensor cores x 512). GPU only (Hopper).
"""
import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _clock():
    z = gl.arange(0, 128, gl.BlockedLayout([1], [32], [4], [0]))
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [z], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _mma_kernel(out_ptr, clk_ptr, ITERS, N: gl.constexpr, RS: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    xb = gl.allocate_shared_memory(gl.bfloat16, [N, 128], gl.NVMMASharedLayout.get_default_for([N, 128], gl.bfloat16))
    xb.store(gl.full([N, 128], 0.5, gl.bfloat16, BL))                                  # (N, 128) tokens
    ab = gl.allocate_shared_memory(gl.bfloat16, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128],
                                                                                               gl.bfloat16))
    ab.store(gl.full([64, 128], 0.25, gl.bfloat16, BL))                                # (64, 128) weights
    fence_async_shared()
    gl.thread_barrier()
    xt = xb.permute((1, 0))                                                             # (128, N)
    a = gl.full([64, 16], 0.25, gl.bfloat16, DOT)
    acc = gl.zeros((64, N), gl.float32, MMA)
    t0 = _clock()
    for i in range(ITERS):
        for r in gl.static_range(8):
            if RS:
                acc = warpgroup_mma(a, xt.slice(16 * r, 16), acc, is_async=True)
            else:
                acc = warpgroup_mma(ab.slice(16 * r, 16, dim=1), xt.slice(16 * r, 16), acc, is_async=True)
            acc = warpgroup_mma_wait(7, deps=[acc])
    acc = warpgroup_mma_wait(0, deps=[acc])
    t1 = _clock()
    z = gl.arange(0, 128, gl.BlockedLayout([1], [32], [4], [0]))
    gl.store(clk_ptr + gl.program_id(0) + z * 0, t1 - t0, mask=z == 0)
    s = gl.sum(gl.sum(acc, axis=1), axis=0)
    gl.store(out_ptr + gl.program_id(0), s)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2000, help="K tiles (8 wgmmas each) a program issues")
    p.add_argument("--n", default="16,32,64,128,256", help="comma-separated wgmma N (tokens)")
    a = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, {a.iters} x 8 wgmmas a program")
    print("| N | operand A | programs an SM | cycles a wgmma (median) | multiply-adds an SM a cycle |")
    print("|---|---|---|---|---|")
    for n in (int(v) for v in a.n.split(",")):
        for rs in (True, False):
            for per in (1, 2):
                grid = per * sms
                out = torch.empty(grid, device="cuda")
                clk = torch.zeros(grid, dtype=torch.int64, device="cuda")
                _mma_kernel[(grid,)](out, clk, 10, N=n, RS=rs, num_warps=4)         # compile and warm up
                _mma_kernel[(grid,)](out, clk, a.iters, N=n, RS=rs, num_warps=4)
                torch.cuda.synchronize()
                cyc = clk.double().median().item() / (a.iters * 8)
                fma = per * 64 * n * 16 / cyc
                print(f"| {n} | {'registers' if rs else 'shared'} | {per} | {cyc:.1f} | {fma:.0f} |")


if __name__ == "__main__":
    main()
