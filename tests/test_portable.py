"""Which GPUs run what (README): the Hopper-only paths and the portable one that every other GPU
takes.

kernels.hopper decides: an sm_90 GPU runs gemm/warp_specialized.py's GEMM and the dequant PTX with
sm_90's bf16x2 multiply; Ampere, Ada and Blackwell run the Triton kernels alone, with the PTX's
multiply done as an fma. NANOQERL_PORTABLE=1 (kernels.PORTABLE) sends a Hopper GPU down the portable
path, so that it is tested here on an H100 (the GPU test) and timed
(`python -m bench kernels --parts gemm --portable`). On CPU: the dispatch with a faked Hopper, and
the kernels compiled offline for sm_80 / sm_89 / sm_120 (Triton ships ptxas; no GPU needed).
"""
import os
import types

import pytest
import torch

import kernels as K
import quantize as Q
from gemm import layout
from gemm import warp_specialized as kernels_ws

CUDA = torch.cuda.is_available()


def gemm_path(x2, w) -> str:
    """Which GEMM kernels.nvfp4_mm runs for x2 (M, K) and w: "ws" (warp-specialized) or "triton"."""
    return "triton" if K.ws_choice(x2, w) is None else "ws"


def make_weight(N, Kdim, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    packed, scale, gs = Q.quantize_weight(torch.randn(N, Kdim, generator=g) * 0.05)
    return layout.pack_nvfp4(packed.to(device), scale.to(device), gs.to(device))


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu((major, minor)): kernels sees a CUDA device of that capability, where kernels_ws may
    run (its own checks pass) and the interpreter is off; the tensors stay on CPU, nothing is
    launched."""
    def fake(cap):
        monkeypatch.setattr(K, "_capability", lambda index: cap)
        monkeypatch.setattr(K, "INTERPRET", False)
        monkeypatch.setattr(kernels_ws, "usable", lambda x2: True)
        return torch.device("cuda", 0)
    return fake


@pytest.mark.parametrize("M", [1, 64, 256])
def test_dispatch_hopper_and_portable(fake_gpu, monkeypatch, M):
    """A Hopper capability takes kernels_ws's GEMM where it wins (64 and 256 tokens of a 7B qkv) and
    Hopper's PTX; the switch on, the same capability takes what an Ampere (8, 0) or Ada (8, 9) GPU
    takes: the Triton kernels, the portable PTX."""
    i32 = torch.zeros(1, 1, 16, dtype=torch.int32)
    # the 7B qkv shape (the dispatch reads n and k)
    w = layout.NVFP4Weight(i32, i32, torch.ones(1), 4608, 3584)
    dev = fake_gpu((9, 0))
    # M tokens on the faked GPU (the dispatch reads these)
    x2 = types.SimpleNamespace(shape=(M, 3584), device=dev)
    monkeypatch.setattr(K, "PORTABLE", False)
    assert K.hopper(dev) and K.asm_mode(dev) == 1
    assert gemm_path(x2, w) == ("ws" if M > K.WS_MIN_M else "triton")
    monkeypatch.setattr(K, "PORTABLE", True)
    portable = (K.hopper(dev), K.asm_mode(dev), gemm_path(x2, w))
    assert portable == (False, 2, "triton")
    monkeypatch.setattr(K, "PORTABLE", False)
    for cap in ((8, 0), (8, 9), (12, 0)):                       # Ampere, Ada, Blackwell consumer
        dev = fake_gpu(cap)
        assert (K.hopper(dev), K.asm_mode(dev), gemm_path(x2, w)) == portable


def test_switch_read_from_the_environment():
    """NANOQERL_PORTABLE=1 is read once, at import (a fresh interpreter shows it)."""
    import subprocess
    import sys
    code = "import kernels; print(kernels.PORTABLE)"
    for value, want in (("1", "True"), ("0", "False")):
        env = {**os.environ, "NANOQERL_PORTABLE": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert out.stdout.strip().splitlines()[-1] == want


# --------------------------------------------------------------------------------------------------
# The kernels compiled offline for the GPUs the portable path is for

# Each case: (kernel, capability, constexprs, warps, stages), compiled in a fresh interpreter with
# the Triton interpreter off (under TRITON_INTERPRET=1, as in these tests, @triton.jit gives
# functions that cannot compile). A kernel is named in kernels.py, or as "module:name"; an argument
# named in the constexprs' "_types" takes that type instead of PTRS's. Each answer: [shared memory
# in bytes, registers a thread, bytes spilled], the last two from the bundled ptxas's report on
# the PTX (what the GPU's driver would allocate), or the compiler's error.
COMPILE = """
import importlib, json, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
PTRS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i32", "gs_ptr": "*fp32", "b_ptr": "*bf16",
        "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "xa_ptr": "*bf16",
        "lb_ptr": "*bf16", "out_ptr": "*bf16", "a_ptr": "*bf16", "sync_ptr": "*i32"}
def registers(ptx, cap):
    arch = re.search(r"^\\.target\\s+(\\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as d:
        open(d + "/k.ptx", "w").write(ptx)
        r = subprocess.run([get_ptxas(cap).path, "-v", "-arch=" + arch, d + "/k.ptx", "-o",
                            d + "/k.cubin"], capture_output=True, text=True, check=True)
    return [int(re.search(p, r.stderr).group(1))
            for p in (r"Used (\\d+) registers", r"(\\d+) bytes spill stores")]
out = []
for name, cap, consts, warps, stages in json.loads(sys.argv[1]):
    module, _, name = name.rpartition(":")
    kernel = getattr(importlib.import_module(module or "kernels"), name)
    types = {**PTRS, **consts.pop("_types", {})}
    sig = {a: types.get(a, "constexpr" if a in consts else "i32") for a in kernel.arg_names}
    try:
        c = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", cap, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        out.append([c.metadata.shared, *registers(c.asm["ptx"], cap)])
    except Exception as e:
        out.append(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
print(json.dumps(out))
"""


def compile_offline(cases) -> list:
    """[shared memory in bytes, registers a thread] of each case's compiled kernel (sm_<cap>, no
    GPU: Triton's bundled ptxas), or the first line of the compiler's error."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(cases)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# the largest of each kernel's configs (mm_config), with bias, a rank-128 LoRA epilogue and
# SiLU x up
MM = dict(BM=128, BN=128, SPLIT_K=1, HAS_BIAS=True, RP=128, UNROLL=1, PEEL=1, GATED=True)
KS = dict(BM=8, BN=32, KS=4, HAS_BIAS=True, RP=128, GATED=True)
DQ = dict(BN=64, TPP=4)
# shared memory a block may use: A100 (sm_80), RTX 30xx (sm_86), RTX 4090 / L40S (sm_89),
# B200 (sm_100), RTX 5090
SMEM = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 100: 227 * 1024, 120: 99 * 1024}


@pytest.mark.skipif(K.triton is None, reason="needs Triton")
def test_kernels_compile_for_other_gpus():
    """The GEMMs and the dequant with the portable PTX (USE_ASM=2) compile for Ampere (sm_80,
    sm_86), Ada (sm_89) and Blackwell (sm_100, sm_120), their largest configs within each GPU's
    shared memory (99 KB on the RTX cards); Hopper's PTX (USE_ASM=1, mul.rn.bf16x2) is refused for
    sm_80, which is why the portable one exists."""
    kernels = (("_nvfp4_mm_kernel", MM, 8, 4),
               ("_nvfp4_mm_ks_kernel", KS, 4, 4),
               ("_nvfp4_dequant_kernel", DQ, 4, 3))
    cases = [(name, cap, {**consts, "USE_ASM": 2}, warps, stages) for cap in (86, 120)
             for name, consts, warps, stages in kernels]
    # the largest
    cases += [("_nvfp4_mm_kernel", cap, {**MM, "USE_ASM": 2}, 8, 4) for cap in (80, 89, 100)]
    cases.append(("_nvfp4_dequant_kernel", 80, {**DQ, "USE_ASM": 1}, 4, 3))
    got = compile_offline(cases)
    for case, compiled in zip(cases[:-1], got[:-1]):
        assert isinstance(compiled, list) and compiled[0] <= SMEM[case[1]], (case, compiled)
    assert isinstance(got[-1], str), got[-1]  # a compile error, not bytes


@pytest.mark.skipif(K.triton is None, reason="needs Triton")
def test_the_fused_a_product_launch_needs_no_more_registers_than_the_gemm_alone():
    """gemm/fused_a at one token (the 7B's q/k/v with bias and gate/up with SiLU x up, rank 32,
    Hopper's PTX): a launch is given the registers of its hungriest branch, so the xa programs'
    branch must not ask for more than the K-sliced GEMM does alone, else an SM holds fewer GEMM
    programs and the weights stream slower. With 128 columns of A a step the fused launch took
    128 registers a thread against the GEMM's 64 and ran 2.8 ms of a batch-1 step's GEMMs where
    the GEMM and the A product's own launch took 2.4 (docs/BENCHMARKS.md)."""
    from gemm import fused_a
    from gemm.configs import mm_config
    cases = []
    for N, Kdim, bias, gated in ((4608, 3584, True, False), (37888, 3584, False, True)):
        cfg = mm_config(1, N, Kdim)
        common = dict(BM=cfg["BM"], BN=cfg["BN"], KS=cfg["KS"], HAS_BIAS=bias, USE_ASM=1, RP=32,
                      GATED=gated)
        fused = dict(common, SPLIT_K=1, PA=-(-Kdim // (fused_a.A_STEPS * fused_a.A_BK)),
                     STEPS=fused_a.A_STEPS, BMA=16, BKA=fused_a.A_BK, UNROLL=1, PEEL=0)
        launch = (cfg["num_warps"], cfg["num_stages"])
        cases += [("_nvfp4_mm_ks_kernel", 90, common, *launch),
                  ("gemm.fused_a:_fused_a_kernel", 90, fused, *launch)]
    got = compile_offline(cases)
    assert all(isinstance(g, list) for g in got), got
    for i in range(0, len(got), 2):
        (_, alone, _), (_, with_xa, spilled) = got[i], got[i + 1]
        assert with_xa <= alone and spilled == 0, (cases[i][2], alone, with_xa, spilled)


@pytest.mark.skipif(K.triton is None, reason="needs Triton")
def test_the_norm_with_the_a_product_spills_nothing():
    """layers/shrink.rms_norm_lora as it launches for the 7B's q/k/v (three rank-32 adapters, 96
    rows of A padded to 128) and gate/up (64), with the residual add, for Hopper: no register
    spilled. With 128 columns a step and 4 warps it spilled 980 bytes a thread at q/k/v, and the
    decode step with it ran 0.56 ms slower than the norm and the shrink apart
    (docs/BENCHMARKS.md)."""
    from layers import shrink
    types = {"w_ptr": "*bf16", "r_ptr": "*bf16", "z_ptr": "*bf16", "h_ptr": "*bf16",
             "eps": "fp32"}
    H = 3584
    tiles = -(-H // shrink.NORM_BK)
    split = -(-tiles // shrink.NORM_STEPS)
    cases = [("layers.shrink:_norm_lora_kernel", 90,
              dict(STEPS=-(-tiles // split), SPLIT=split, HAS_RES=True, HAS_NOISE=False,
                   BM=shrink.NORM_BM, BR=BR, BK=shrink.NORM_BK, ON_CPU=False, _types=types),
              shrink.NORM_WARPS, 3) for BR in (128, 64)]
    got = compile_offline(cases)
    assert all(isinstance(g, list) and g[2] == 0 for g in got), got


# --------------------------------------------------------------------------------------------------
# On a GPU: the portable path's numbers

@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 64, 256])
def test_portable_gemm_cuda(monkeypatch, M):
    """With the switch on (on an H100: the path an A100 or RTX 4090 takes), the NVFP4 GEMM at the 7B
    qkv shape against the fp32 reference, within one bf16 rounding plus fp32 accumulation in another
    order; and the same bits as the full path wherever both run the Triton kernel (Hopper's PTX and
    the portable one agree)."""
    N, Kd = 4608, 3584
    w = make_weight(N, Kd, device="cuda", seed=M)
    x = torch.randn(M, Kd, device="cuda").to(torch.bfloat16)
    full_path = gemm_path(x, w)
    full = K.nvfp4_mm(x, w)
    monkeypatch.setattr(K, "PORTABLE", True)
    assert gemm_path(x, w) == "triton" and K.asm_mode(x.device) == 2
    y = K.nvfp4_mm(x, w)
    W = K.dequantize_ref(w)
    y32 = x.float() @ W.t()
    tol = (2.0 ** -8 * y32.abs()
           + 4 * Kd ** 0.5 * 2.0 ** -24 * (x.float().abs() @ W.abs().t()) + 1e-30)
    assert ((y.float() - y32).abs() <= tol).all()
    if full_path == "triton" and torch.cuda.get_device_capability() == (9, 0):
        assert torch.equal(y, full)
