"""kernels.py: the Triton kernels against their PyTorch references.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest) with the pure-Triton dequant
twin of the PTX; on a CUDA machine the same tests run the real kernels (PTX dequant, wgmma), plus
the 7B shapes.
"""
import os

import pytest
import torch

import kernels as K
import quantize as Q
from gemm import layout
from layers import ops
from layers import sampler

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]  # CPU: the interpreter; a GPU machine runs the real kernels


@pytest.fixture(autouse=True)
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(K, "CPU_TRITON", True)


def make_weight(N, Kdim, seed=0, device="cpu", zero_block=True):
    g = torch.Generator().manual_seed(seed)
    # rows of different scales
    w = torch.randn(N, Kdim, generator=g) * torch.rand(N, 1, generator=g) * 0.05
    if zero_block and Kdim >= 32:
        w[0, 16:32] = 0.0
    packed, scale, gs = Q.quantize_weight(w)
    return (layout.pack_nvfp4(packed.to(device), scale.to(device), gs.to(device)),
            (packed, scale, gs))


def test_pack_roundtrip_and_reference_dequant():
    for N, Kd in [(3, 16), (80, 144), (130, 272)]:
        w, (packed, scale, gs) = make_weight(N, Kd)
        codes = Q.unpack_codes(packed)
        assert torch.equal(layout.unpack_codes(w)[:N, :Kd], codes.long())
        assert ((layout.unpack_codes(w)[N:] == 0).all()
                and (layout.unpack_codes(w)[:, Kd:] == 0).all())
        assert torch.equal(K.dequantize_ref(w), Q.dequantize_weight(packed, scale, gs))
        assert w.words.shape == (-(-Kd // 128), -(-N // 128) * 128, 16)
        assert w.scales.shape == (-(-Kd // 128), -(-N // 128) * 128, 2)


def expected(x, w, bias=None):
    """fp32 result and the tolerance the kernel must meet: one bf16 rounding of the output plus fp32
    accumulation in another order, as a fraction of sum |x||w|: 1e-5, or 4 sqrt(K) 2^-24 for long K
    (rounding errors of mixed sign add up like a random walk; K = 18944, the 7B down_proj, needs
    3.3e-5). The rounding is half an ulp (2^-8 relative) on the GPU; Triton's CPU interpreter
    truncates fp32 -> bf16 instead, a whole ulp (2^-7)."""
    W = K.dequantize_ref(w).to(x.device)
    y32 = x.float() @ W.t() + (bias.float() if bias is not None else 0.0)
    acc = max(1e-5, 4 * x.shape[-1] ** 0.5 * 2.0 ** -24)
    tol = ROUND[x.device.type] * y32.abs() + acc * (x.float().abs() @ W.abs().t()) + 1e-30
    return y32, tol


ROUND = {"cuda": 2.0 ** -8, "cpu": 2.0 ** -7}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,N,Kd", [(1, 64, 16),
                                    (1, 80, 144),
                                    (5, 96, 128),
                                    (16, 130, 256),
                                    (33, 64, 400),
                                    (70, 128, 128)])
def test_gemm_matches_reference(device, M, N, Kd):
    w, _ = make_weight(N, Kd, seed=M + N + Kd, device=device)
    x = torch.randn(M, Kd, device=device).to(torch.bfloat16)
    y = K.nvfp4_mm(x, w)
    y32, tol = expected(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert ((y.float() - y32).abs() <= tol).all(), (y.float() - y32).abs().max()
    ref = K.nvfp4_linear_ref(x, w)
    assert ((y.float() - ref.float()).abs() <= 2 * tol).all()


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_split_k_bias_and_batched_input(device):
    w, _ = make_weight(96, 512, seed=3, device=device)
    bias = torch.randn(96, device=device).to(torch.bfloat16)
    x = torch.randn(2, 3, 512, device=device).to(torch.bfloat16)
    for split in (1, 2, 4):
        y = K.nvfp4_mm(x.reshape(6, 512), w, bias,
                       config=dict(BM=16, BN=64, SPLIT_K=split, num_warps=4, num_stages=2))
        y32, tol = expected(x.reshape(6, 512), w, bias)
        assert ((y.float() - y32).abs() <= tol).all(), split
    # counters reset themselves: a second split-K call on the same workspace still adds every
    # split once
    y2 = K.nvfp4_mm(x.reshape(6, 512), w, bias,
                    config=dict(BM=16, BN=64, SPLIT_K=4, num_warps=4, num_stages=2))
    assert torch.equal(y, y2)
    out = K.nvfp4_linear(x, w, bias)
    assert out.shape == (2, 3, 96)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [dict(BM=64, BN=64, SPLIT_K=1, num_warps=4, num_stages=3),
                                 dict(BM=128, BN=64, SPLIT_K=2, num_warps=4, num_stages=3),
                                 dict(BM=128, BN=128, SPLIT_K=4, num_warps=8, num_stages=4)])
def test_gemm_first_tile_peeled(device, cfg):
    """PEEL=1 (the first K tile of each split outside the loop, as mm_config picks above 16 tokens)
    gives the same bits as the plain loop: 9 K tiles, so splits of 5 + 4 and 3 x 3 tiles, and 70
    tokens / 130 rows in partial tiles."""
    w, _ = make_weight(130, 1104, seed=7, device=device)
    x = torch.randn(70, 1104, device=device).to(torch.bfloat16)
    y = K.nvfp4_mm(x, w, config=dict(cfg, PEEL=1))
    y32, tol = expected(x, w)
    assert ((y.float() - y32).abs() <= tol).all(), (y.float() - y32).abs().max()
    assert torch.equal(y, K.nvfp4_mm(x, w, config=dict(cfg, PEEL=0)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,N,Kd,BM,BN,KS", [(1, 64, 16, 1, 16, 2),
                                             (1, 80, 400, 1, 16, 4),
                                             (3, 96, 1104, 4, 32, 4),
                                             (16, 130, 256, 16, 16, 8),
                                             (9, 64, 1104, 16, 64, 2)])
def test_gemm_k_sliced(device, M, N, Kd, BM, BN, KS):
    """The K-sliced kernel (config KS: K tiles dealt round-robin to KS slices of one program, summed
    at the end) against the fp32 expectation: K tiles that do not fill the last round (4 tiles over
    8 slices, 9 over 2 or 4), partial row and token tiles, a bias and the LoRA epilogue term."""
    w, _ = make_weight(N, Kd, seed=M + Kd, device=device)
    g = torch.Generator().manual_seed(N)
    x = torch.randn(M, Kd, generator=g).to(device, torch.bfloat16)
    bias = torch.randn(N, generator=g).to(device, torch.bfloat16)
    xa = torch.randn(M, 8, generator=g).to(device, torch.bfloat16)
    B = (0.1 * torch.randn(N, 8, generator=g)).to(device, torch.bfloat16)
    cfg = dict(BM=BM, BN=BN, KS=KS, num_warps=KS, num_stages=2)
    y = K.nvfp4_mm(x, w, bias, config=cfg)
    y32, tol = expected(x, w, bias)
    assert ((y.float() - y32).abs() <= tol).all(), (y.float() - y32).abs().max()
    yl = K.nvfp4_mm(x, w, bias, config=cfg, lora=(xa, B))
    term = xa.float() @ B.float().t()
    tol = tol + ROUND[device] * term.abs() + 1e-5 * (xa.float().abs() @ B.float().abs().t())
    assert ((yl.float() - y32 - term).abs() <= tol).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("KS,warps", [(2, 4), (4, 8)])
def test_gemm_k_sliced_two_warps_a_slice(device, M, KS, warps):
    """Two warps a K slice (rows split between them; bench/sweep.py's ks configs time these) give
    the right sums at 1-8 tokens. (Fewer warps than slices did not on the H100, at one token:
    nvfp4_mm refuses those, see test_errors.)"""
    w, _ = make_weight(96, 1104, seed=M, device=device)
    x = torch.randn(M, 1104, generator=torch.Generator().manual_seed(M)).to(device, torch.bfloat16)
    cfg = dict(BM=1 << (M - 1).bit_length(), BN=32, KS=KS, num_warps=warps, num_stages=3)
    y32, tol = expected(x, w)
    assert ((K.nvfp4_mm(x, w, config=cfg).float() - y32).abs() <= tol).all()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (Gluon kernels have no CPU interpreter)")
@pytest.mark.parametrize("M,N,Kd", [(40, 64, 16),
                                    (33, 130, 1104),
                                    (64, 200, 272),
                                    (100, 130, 1104),
                                    (513, 96, 400),
                                    (130, 96, 768),
                                    (200, 4608, 3584)])
def test_ws_gemm_matches_reference(M, N, Kd):
    """kernels_ws (warp-specialized, Hopper) against fp32: K of 1 to 28 tiles (16 = the smallest,
    zero-filled by TMA; no whole lap of the ring, whole laps only, laps and 1-3 tiles after them),
    partial token and weight-row tiles, bias, each token tile and register budget, K split 2 to 7
    ways; the same bits when repeated, and as kernels.py's Triton GEMM with the same tile
    and split."""
    from gemm import warp_specialized as kernels_ws
    w, _ = make_weight(N, Kd, seed=M + N + Kd, device="cuda")
    x = torch.randn(M, Kd, device="cuda").to(torch.bfloat16)
    if not kernels_ws.usable(x):
        pytest.skip("needs a Hopper GPU and Triton's Gluon")
    bias = torch.randn(N, device="cuda").to(torch.bfloat16)
    for b in (None, bias):
        y32, tol = expected(x, w, b)
        for cfg in (dict(BM=64, maxnreg=128), dict(BM=64, maxnreg=None), dict(BM=128, maxnreg=None),
                    dict(BM=256, maxnreg=None)):
            y = kernels_ws.ws_mm(x, w, b, config=cfg)
            assert y.shape == (M, N) and ((y.float() - y32).abs() <= tol).all(), \
                (cfg, (y.float() - y32).abs().max())
            assert torch.equal(y, kernels_ws.ws_mm(x, w, b, config=cfg))
            # the same products in the same order as the Triton kernel's tiles
            if b is None and cfg["BM"] < 256:
                tri = dict(BM=cfg["BM"], BN=64, SPLIT_K=1, num_warps=4, num_stages=3, PEEL=1)
                assert torch.equal(y, K.nvfp4_mm(x, w, config=tri))
        # K split: partials, last one adds
        for split in (s for s in (2, 3, 4, 7) if w.words.shape[0] % s == 0):
            cfg = dict(BM=64, maxnreg=128, SPLIT=split)
            y = kernels_ws.ws_mm(x, w, b, config=cfg)
            assert ((y.float() - y32).abs() <= tol).all(), (cfg, (y.float() - y32).abs().max())
            for _ in range(2):  # again: the tile counters reset themselves
                assert torch.equal(y, kernels_ws.ws_mm(x, w, b, config=cfg))
            if b is None:  # the same split, partials and order as the Triton kernel's
                tri = dict(BM=64, BN=64, SPLIT_K=split, num_warps=4, num_stages=3, PEEL=1)
                assert torch.equal(y, K.nvfp4_mm(x, w, config=tri))
    cfg = kernels_ws.ws_config(M, N, Kd)
    # the dispatch runs it with this config
    if cfg is not None and M > K.WS_MIN_M:
        assert torch.equal(K.nvfp4_mm(x, w, bias), kernels_ws.ws_mm(x, w, bias, cfg))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (Gluon kernels have no CPU interpreter)")
@pytest.mark.parametrize("M,N,Kd,R", [(40, 64, 400, 8),
                                      (64, 200, 1104, 24),
                                      (100, 130, 768, 32),
                                      (300, 96, 272, 128)])
def test_ws_gemm_lora(M, N, Kd, R):
    """kernels_ws's LoRA epilogue term (xa @ B^T on wgmma, once per output tile) against fp32: ranks
    that are and are not multiples of 16 up to 128, partial token and weight-row tiles, each token
    tile, a bias, K split 1 to 4 (the term rides in split 0's partial); and kernels.nvfp4_mm's
    dispatch with lora= takes the same path."""
    from gemm import warp_specialized as kernels_ws
    w, _ = make_weight(N, Kd, seed=M + R, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, Kd, device="cuda", generator=g).to(torch.bfloat16)
    if not kernels_ws.usable(x):
        pytest.skip("needs a Hopper GPU and Triton's Gluon")
    bias = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
    xa = torch.randn(M, R, device="cuda", generator=g).to(torch.bfloat16)
    B = (0.1 * torch.randn(N, R, device="cuda", generator=g)).to(torch.bfloat16)
    y32, tol = expected(x, w, bias)
    term = xa.float() @ B.float().t()
    tol = tol + ROUND["cuda"] * term.abs() + 1e-5 * (xa.float().abs() @ B.float().abs().t())
    KT = w.words.shape[0]
    cfgs = [dict(BM=64, maxnreg=128), dict(BM=128, maxnreg=None), dict(BM=256, maxnreg=None)]
    cfgs += [dict(BM=64, maxnreg=128, SPLIT=s) for s in (2, 3, 4) if KT % s == 0]
    for cfg in cfgs:
        yl = kernels_ws.ws_mm(x, w, bias, config=cfg, lora=(xa, B))
        err = (yl.float() - y32 - term).abs()
        assert (err <= tol).all(), (cfg, err.max())
    cfg = kernels_ws.ws_config(M, N, Kd)
    if cfg is not None and M > K.WS_MIN_M:
        assert torch.equal(K.nvfp4_mm(x, w, bias, lora=(xa, B)),
                           kernels_ws.ws_mm(x, w, bias, cfg, lora=(xa, B)))
    with pytest.raises(ValueError, match="lora must be"):
        kernels_ws.ws_mm(x, w, bias, config=cfgs[0], lora=(xa, B.t()))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (Gluon kernels have no CPU interpreter)")
@pytest.mark.parametrize("N,Kd", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
def test_ws_gemm_7b_shapes_bit_for_bit(N, Kd):
    """At the 7B linear shapes, kernels_ws gives the same bits as kernels.py's Triton GEMM with the
    same tile and K split (64-512 tokens, 64 / 128 / 256-token tiles, partial token tiles, 2-5
    stages, 128 / 168 / 255 registers), with and without its timer stamps, and meets the fp32
    tolerance: the check that caught in-flight wgmma operands being overwritten
    (tests/test_ws_sass.py)."""
    from gemm import warp_specialized as kernels_ws
    w, _ = make_weight(N, Kd, seed=N + Kd, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(N)
    for M, (BM, nreg, S, split) in [(64, (64, 128, 4, 1)),
                                    (200, (128, None, 3, 1)),
                                    (200, (64, 128, 5, 2)),
                                    (512, (128, 168, 4, 1)),
                                    (100, (128, None, 4, 2)),
                                    (300, (256, None, 3, 1)),
                                    (256, (256, None, 2, 2))]:
        x = torch.randn(M, Kd, device="cuda", generator=g).to(torch.bfloat16)
        if not kernels_ws.usable(x):
            pytest.skip("needs a Hopper GPU and Triton's Gluon")
        y = kernels_ws.ws_mm(x, w, config=dict(BM=BM, maxnreg=nreg, S=S, SPLIT=split))
        st = torch.zeros(4 * (-(-N // 64)) * (-(-M // BM)) * split, dtype=torch.int64,
                         device="cuda")
        assert torch.equal(y, kernels_ws.ws_mm(x, w,
                                               config=dict(BM=BM, maxnreg=nreg, S=S, SPLIT=split),
                                               stamps=st))
        # each program's 4 stamps, in order
        assert (st > 0).all() and (st.view(-1, 4).diff(dim=1) >= 0).all()
        tri = dict(BM=BM, BN=64, SPLIT_K=split, num_warps=4, num_stages=3 if BM < 256 else 2,
                   PEEL=1)
        assert torch.equal(y, K.nvfp4_mm(x, w, config=tri)), (M, BM, nreg, S, split)
        y32, tol = expected(x, w)
        assert ((y.float() - y32).abs() <= tol).all(), (M, (y.float() - y32).abs().max())


def test_ws_config_is_launchable():
    """Every choice of kernels_ws.ws_config, over the Qwen2.5 / Qwen3 / Llama linear shapes and
    33..1023 tokens, is a config ws_mm runs: a 64-, 128- or 256-token tile with its register budget
    and a K split dividing the K tiles, and a ring deeper than the default (5 stages) only for
    64-token tiles, two programs an SM."""
    from gemm import warp_specialized as kernels_ws
    shapes = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944),
              (7168, 5120), (5120, 5120), (55296, 5120), (5120, 27648),
              (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
              (4096, 11008), (2560, 2048)]
    seen = set()
    for N, Kd in shapes:
        for M in [*range(K.WS_MIN_M + 1, K.LARGE_M, 7), 64]:
            cfg = kernels_ws.ws_config(M, N, Kd)
            if cfg is None:
                continue
            seen.add((cfg["BM"], cfg.get("SPLIT", 1), cfg.get("S")))
            assert set(cfg) <= {"BM", "maxnreg", "SPLIT", "S"}
            assert cfg.get("S") in (None, 5) and (cfg.get("S") is None or cfg["BM"] == 64), \
                (M, N, Kd, cfg)
            assert cfg["maxnreg"] == {64: 128, 128: None, 256: None}[cfg["BM"]], (M, N, Kd, cfg)
            assert -(-Kd // 128) % cfg.get("SPLIT", 1) == 0, (M, N, Kd, cfg)
    # every branch is taken somewhere
    assert {(64, 1, None), (64, 2, None), (64, 1, 5), (64, 4, 5), (128, 1, None), (128, 2, None),
            (256, 1, None)} <= seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,R,split", [(1, 8, 1), (5, 96, 2), (20, 32, 1), (20, 32, 4)])
def test_gemm_lora_epilogue(device, M, R, split):
    """lora=(xa, B) adds xa @ B^T (the rollout's LoRA snapshot, R = sum of ranks, padded inside the
    kernel to a power of two >= 16) before the single output rounding, with and without split-K; the
    fp32 expectation gets the term in fp32 and the same tolerance plus fp32 accumulation error of
    the R-long sum."""
    w, _ = make_weight(96, 512, seed=M + R, device=device)
    g = torch.Generator().manual_seed(R)
    x = torch.randn(M, 512, generator=g).to(device, torch.bfloat16)
    xa = torch.randn(M, R, generator=g).to(device, torch.bfloat16)
    B = (0.1 * torch.randn(96, R, generator=g)).to(device, torch.bfloat16)
    bias = torch.randn(96, generator=g).to(device, torch.bfloat16)
    cfg = dict(BM=16 if M <= 16 else 32, BN=64, SPLIT_K=split, num_warps=4, num_stages=2)
    y = K.nvfp4_mm(x, w, bias, config=cfg, lora=(xa, B))
    y32, tol = expected(x, w, bias)
    y32 = y32 + xa.float() @ B.float().t()
    tol = (tol + ROUND[device] * (xa.float() @ B.float().t()).abs()
           + 1e-5 * (xa.float().abs() @ B.float().abs().t()))
    print(f"lora epilogue {device} M={M} R={R} split={split}: "
          f"max |y - y32| {(y.float() - y32).abs().max().item():.3g}")
    assert ((y.float() - y32).abs() <= tol).all()
    # the term is really there
    assert not torch.allclose(y, K.nvfp4_mm(x, w, bias, config=cfg), atol=1e-2)
    with pytest.raises(ValueError, match="lora must be"):
        K.nvfp4_mm(x, w, bias, config=cfg, lora=(xa, B[:, :-1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,cfg,R", [
    (1, None, 0),
    (3, dict(BM=4, BN=32, KS=4, num_warps=4, num_stages=2), 24),
    (16, None, 0),
    (20, dict(BM=32, BN=64, SPLIT_K=4, num_warps=4, num_stages=2), 24)])
def test_gemm_gated_silu_epilogue(device, M, cfg, R):
    """gated=I returns silu(gate) * up from the epilogue: the same bits as the GEMM's output through
    ops.silu_mul (gate rows [0, 128), up rows [128, 256), I = 100 real columns each), K-sliced and
    split-K, with a LoRA term."""
    w, _ = make_weight(256, 384, seed=M, device=device)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 384, generator=g).to(device, torch.bfloat16)
    lora = (torch.randn(M, R, generator=g).to(device, torch.bfloat16),
            (0.1 * torch.randn(256, R, generator=g)).to(device, torch.bfloat16)) if R else None
    y = K.nvfp4_mm(x, w, config=cfg, lora=lora, gated=100)
    want = ops.silu_mul(K.nvfp4_mm(x, w, config=cfg, lora=lora), 100, 128)
    assert y.shape == (M, 100) and torch.equal(y, want), (y.float() - want.float()).abs().max()
    with pytest.raises(ValueError, match="gated"):
        K.nvfp4_mm(x, w, gated=129)


@pytest.mark.parametrize("device", DEVICES)
def test_dequant_kernel(device):
    w, (packed, scale, gs) = make_weight(80, 272, seed=1, device=device)
    got = K.dequantize(w)
    ref = Q.dequantize_weight(packed, scale, gs).to(device)
    assert got.dtype == torch.bfloat16 and got.shape == (80, 272)
    # kernel: bf16(exact(q*s) * (1/gs)); reference: q * (s/gs) in fp32 -> one rounding apart
    assert ((got.float() - ref).abs() <= ROUND[device] * ref.abs()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_linear_backward_dx(device):
    w, _ = make_weight(96, 144, seed=2, device=device)
    x = torch.randn(7, 144, device=device).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(7, 96, device=device).to(torch.bfloat16)
    K.nvfp4_linear(x, w).backward(dy)
    xr = x.detach().float().requires_grad_(True)
    (xr @ K.dequantize_ref(w).to(device).t()).backward(dy.float())
    # dX = dY @ W_hat: the kernel uses bf16 W_hat (<= 1 ulp from fp32) and a bf16 output
    tol = 2.0 ** -7 * xr.grad.abs() + 1e-2 * xr.grad.abs().max()
    assert ((x.grad.float() - xr.grad).abs() <= tol).all()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_ptx_dequant_matches_pure_triton_twin():
    """The pure-Triton dequant (what the CPU interpreter runs) and the PTX one compute the same
    products."""
    w, _ = make_weight(130, 400, seed=5, device="cuda")
    x = torch.randn(9, 400, device="cuda").to(torch.bfloat16)
    ptx, twin = K.nvfp4_mm(x, w, use_asm=True), K.nvfp4_mm(x, w, use_asm=False)
    y32, tol = expected(x, w)
    assert ((ptx.float() - y32).abs() <= tol).all() and ((twin.float() - y32).abs() <= tol).all()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 16, 40, 64, 128, 256, 512, 2048])
@pytest.mark.parametrize("N,Kd", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
def test_gemm_7b_shapes_cuda(M, N, Kd):
    w, _ = make_weight(N, Kd, seed=M, device="cuda")
    x = torch.randn(M, Kd, device="cuda").to(torch.bfloat16)
    y = K.nvfp4_linear(x, w)
    y32, tol = expected(x, w)
    # dequantize + cuBLAS: W_hat is rounded to bf16 first (2^-9 relative per weight)
    if M >= K.LARGE_M:
        tol = tol + 2.0 ** -9 * (x.float().abs() @ K.dequantize_ref(w).abs().t())
    bad = ((y.float() - y32).abs() > tol).float().mean().item()
    assert bad == 0.0, (bad, ((y.float() - y32).abs() / tol).max().item())


# --------------------------------------------------------------------------------------------------
# RMSNorm

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 200])
@pytest.mark.parametrize("with_noise,with_res", [(False, False),
                                                 (True, False),
                                                 (True, True),
                                                 (False, True)])
def test_rms_norm_forward(device, dtype, H, with_noise, with_res):
    g = torch.Generator().manual_seed(H)
    x = (3 * torch.randn(5, H, generator=g)).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(device, dtype)
    noise = (0.01 * torch.randn(H, generator=g)).to(device) if with_noise else None
    res = torch.randn(5, H, generator=g).to(device, dtype) if with_res else None
    got = ops.rms_norm(x, weight, 1e-6, noise, res)
    ref = ops.rms_norm_ref(x, weight, 1e-6, noise, res)
    got, ref = (got, ref) if with_res else ((got,), (ref,))
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype == dtype
        # same roundings as HF; rsqrt in Triton vs torch may differ in the last fp32 bit, which can
        # move a bf16 rounding by one ulp (2^-7 relative). The CPU interpreter truncates each of its
        # (up to 3: h, x_hat, y) bf16 casts instead of rounding to nearest: 4 ulps there. fp32
        # checks the math tightly.
        ulp = (2.0 ** -7 if device == "cuda" else 2.0 ** -5) if dtype == torch.bfloat16 else 1e-6
        assert ((a.float() - b.float()).abs() <= ulp * b.float().abs() + 1e-6).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_noise,with_res", [(False, False), (True, True)])
@pytest.mark.parametrize("M,H", [(6, 96), (5, 40)] + ([(1001, 3584), (333, 5120)] if CUDA else []))
def test_rms_norm_backward(device, with_noise, with_res, M, H):
    """dX (and dresidual) and dW against autograd on the reference, fp32; on a GPU also the 7B / 32B
    widths with more rows than programs (several rows per program and a ragged last one)."""
    g = torch.Generator().manual_seed(7)
    x = (2 * torch.randn(M, H, generator=g)).to(device).requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(device).requires_grad_(True)
    noise = (0.01 * torch.randn(H, generator=g)).to(device) if with_noise else None
    res = torch.randn(M, H, generator=g).to(device).requires_grad_(True) if with_res else None
    dy = torch.randn(M, H, generator=g).to(device)
    dh = torch.randn(M, H, generator=g).to(device)

    def run(fn):
        for t in (x, weight) + ((res,) if with_res else ()):
            t.grad = None
        out = fn(x, weight, 1e-6, noise, res)
        loss = (out[0] * dy).sum() + (out[1] * dh).sum() if with_res else (out * dy).sum()
        loss.backward()
        return [t.grad.clone() for t in (x, weight) + ((res,) if with_res else ())]

    # dW sums M rows: its tolerance grows with M
    for a, b in zip(run(ops.rms_norm), run(ops.rms_norm_ref)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * max(1, M // 100)), (a - b).abs().max()


def norm_weight(H, g, device, dtype=torch.bfloat16):
    """|w| uniform in [0.5, 2] with random signs, as trained RMSNorm weights mostly are."""
    mag = 0.5 + 1.5 * torch.rand(H, generator=g)
    return (mag * torch.where(torch.rand(H, generator=g) < 0.5, -1.0, 1.0)).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [ops.rms_norm_ref, ops.rms_norm], ids=["reference", "triton"])
@pytest.mark.parametrize("with_res", [False, True])
def test_rms_norm_small_noise_moves_bf16_outputs(device, fn, with_res):
    """AQN's last stage (sigma 5e-4) on bf16 weights in [0.5, 2]: bf16(w + z) == w there for every
    channel, so a norm that rounds w + z to bf16 changes nothing. With w + z in fp32 most channels'
    output columns move (a single output moves only when the z x_hat change crosses a bf16 rounding
    boundary, about 7% of the time, so a channel is judged over 64 rows; those with the smallest |z|
    stay put: 88% move here), and each output that moves goes the way z * x_hat points."""
    g = torch.Generator().manual_seed(11)
    M, H = 64, 128
    x = torch.randn(M, H, generator=g).to(device, torch.bfloat16)
    res = torch.randn(M, H, generator=g).to(device, torch.bfloat16) if with_res else None
    w = norm_weight(H, g, device)
    z = (5e-4 * torch.randn(H, generator=g)).to(device)
    # rounded to bf16, the noise is gone
    assert torch.equal((w.float() + z).to(torch.bfloat16), w)
    clean, noisy = fn(x, w, 1e-6, None, res), fn(x, w, 1e-6, z, res)
    if with_res:
        # h = x + residual does not see the noise
        assert torch.equal(noisy[1], clean[1])
        clean, noisy = clean[0], noisy[0]
    assert noisy.dtype == torch.bfloat16
    moved = noisy != clean                                               # (M, H)
    assert moved.any(0).float().mean() >= 0.75, moved.any(0).float().mean()
    h = x if res is None else (x.float() + res.float()).to(torch.bfloat16)
    # sign of z * x_hat (rstd > 0)
    push = torch.sign(z) * torch.sign(h.float())
    assert torch.equal(torch.sign((noisy.float() - clean.float())[moved]), push[moved])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_res", [False, True])
def test_rms_norm_fp32_noise_on_bf16_weight_forward_backward(device, with_res):
    """bf16 weights, fp32 activations, sigma 5e-4: the Triton kernel and the reference both against
    the float64 formula with w + z kept exact: y = (w + z) x_hat;
    dX = rstd (dy (w + z) - x_hat mean(dy (w + z) x_hat)); dW = sum over rows of dy x_hat (no noise
    term: d(w + z)/dw = 1). Rounding w + z to bf16 would drop z entirely (an error of |z x_hat|,
    about 4e-4, far above these fp32 tolerances)."""
    g = torch.Generator().manual_seed(5)
    M, H = 6, 96
    x0 = (2 * torch.randn(M, H, generator=g)).to(device)
    r0 = torch.randn(M, H, generator=g).to(device) if with_res else None
    w0 = norm_weight(H, g, device)
    z = (5e-4 * torch.randn(H, generator=g)).to(device)
    dy, dh = torch.randn(M, H, generator=g).to(device), torch.randn(M, H, generator=g).to(device)
    # float64 expectations
    h64 = x0.double() + (r0.double() if with_res else 0)
    rstd = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6)
    xhat = h64 * rstd
    weff = w0.double() + z.double()
    y64 = weff * xhat
    g64 = dy.double() * weff
    dx64 = (rstd * (g64 - xhat * (g64 * xhat).mean(-1, keepdim=True))
            + (dh.double() if with_res else 0))
    dw64 = (dy.double() * xhat).sum(0)
    for fn in (ops.rms_norm, ops.rms_norm_ref):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        r = r0.clone().requires_grad_(True) if with_res else None
        out = fn(x, w, 1e-6, z, r)
        y = out[0] if with_res else out
        loss = (y * dy).sum() + ((out[1] * dh).sum() if with_res else 0)
        loss.backward()
        assert y.dtype == torch.float32 and w.grad.dtype == torch.bfloat16
        assert torch.allclose(y.double(), y64, rtol=1e-5, atol=1e-6), \
            (fn.__name__, (y.double() - y64).abs().max())
        assert torch.allclose(x.grad.double(), dx64, rtol=1e-4, atol=1e-5), \
            (fn.__name__, (x.grad - dx64).abs().max())
        if with_res:
            assert torch.allclose(r.grad.double(), dx64, rtol=1e-4, atol=1e-5)
        # dW is rounded to the bf16 weight
        assert torch.allclose(w.grad.double(), dw64, rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_backward_bf16_with_small_noise(device):
    """All-bf16 backward with AQN noise: the kernel (fp32 inside, one rounding per output) against
    autograd on the reference (which rounds its intermediate gradients to bf16): within a few bf16
    ulps overall."""
    g = torch.Generator().manual_seed(3)
    M, H = 8, 64
    x = (2 * torch.randn(M, H, generator=g)).to(device, torch.bfloat16).requires_grad_(True)
    w = norm_weight(H, g, device).requires_grad_(True)
    z = (5e-4 * torch.randn(H, generator=g)).to(device)
    dy = torch.randn(M, H, generator=g).to(device, torch.bfloat16)
    grads = []
    for fn in (ops.rms_norm, ops.rms_norm_ref):
        x.grad = w.grad = None
        (fn(x, w, 1e-6, z) * dy).float().sum().backward()
        grads.append((x.grad.float(), w.grad.float()))
    for a, b in zip(*grads):
        assert (a - b).norm() <= 2e-2 * b.norm(), ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------------------------------
# SiLU x up, RoPE + cache write

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,pad", [((1, 1, 40), 24), ((2, 3, 1100), 24), ((3, 64), 0)])
def test_silu_mul_matches_reference(device, dtype, shape, pad):
    """gate and up as the two halves of a (padded) fused gate_up output, as the MLP passes it;
    forward and backward against autograd on the reference. The kernel rounds where torch's ops
    round (silu, then the product; backward: dy * up, then the silu derivative, and dy * silu); exp
    may differ from torch's in the last fp32 bit, which can move a bf16 rounding by one ulp (two
    roundings: 2 * 2^-7 relative; the interpreter truncates instead of rounding: 2 * 2^-6). fp32:
    1e-6 relative. The padding columns get a zero gradient."""
    g = torch.Generator().manual_seed(shape[-1])
    N = shape[-1]
    y = (4 * torch.randn(*shape[:-1], 2 * N + pad,  # (..., 2 N + pad)
                         generator=g)).to(device, dtype)
    dy = torch.randn(*shape, generator=g).to(device, dtype)
    rel = ((2 * 2.0 ** -7 if device == "cuda" else 2 * 2.0 ** -6) if dtype == torch.bfloat16
           else 1e-6)
    outs = []
    for fn in (ops.silu_mul, ops.silu_mul_ref):
        gu = y.clone().requires_grad_(True)
        out = fn(gu, N, N + pad)
        (out.float() * dy.float()).sum().backward()
        outs.append((out.detach(), gu.grad))
    (got, dgot), (ref, dref) = outs
    assert got.shape == tuple(shape) and got.dtype == dtype and got.is_contiguous()
    for a, b, what in ((got, ref, "forward"), (dgot, dref, "backward")):
        err = (a.float() - b.float()).abs()
        print(f"silu_mul {what} {device} {dtype} {shape}: "
              f"max |kernel - reference| {err.max().item():.3g}")
        assert (err <= rel * b.float().abs() + 1e-6).all(), what
    assert (dgot[..., N:N + pad] == 0).all()
    with pytest.raises(ValueError, match="disjoint"):
        ops.silu_mul(y, N, N - 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,separate", [(1, False), (5, False), (3, True)])
def test_rope_cache_matches_reference(device, dtype, T, separate):
    """q/k/v as views of one fused projection output (or separate tensors, as after Qwen3's q/k
    norms), cos/sin of real positions, arbitrary cache slots. The kernel rounds each product like
    torch's ops (compiled without FMA contraction), so exact on the GPU; bf16 under the interpreter
    one ulp per rounding (it truncates to bf16)."""
    g = torch.Generator().manual_seed(T)
    B, HQ, HK, D, S = 3, 4, 2, 16, 12
    # a padded fused output
    y = torch.randn(B, T, (HQ + 2 * HK) * D + 8, generator=g).to(device, dtype)
    q, k, v = (y[..., :HQ * D].view(B, T, HQ, D), y[..., HQ * D:(HQ + HK) * D].view(B, T, HK, D),
               y[..., (HQ + HK) * D:(HQ + 2 * HK) * D].view(B, T, HK, D))
    if separate:
        q, k = q.contiguous() * 1.5, k.contiguous() * 0.5
    pos = torch.randint(0, 1000, (B, T), generator=g).float()
    emb = pos[..., None] * (1e4 ** -(torch.arange(0, D, 2) / D))
    cos, sin = (torch.cat((emb, emb), -1).cos().to(device, dtype),
                torch.cat((emb, emb), -1).sin().to(device, dtype))
    slots = torch.randperm(S, generator=g)[:T].to(device)
    cache0 = torch.randn(2, B, HK, S, D, generator=g).to(device, dtype)
    caches = [cache0.clone(), cache0.clone()]
    ref_q = ops.rope_cache_ref(q, k, v, cos, sin, caches[0][0], caches[0][1], slots)
    out_q = ops.rope_cache(q, k, v, cos, sin, caches[1][0], caches[1][1], slots)
    # exact on the GPU and in fp32; bf16 in the interpreter: the products and the sum are each
    # truncated, so at most one bf16 ulp of |x| apart per rounding: 3 * 2^-7 * max |x|
    # (|cos|, |sin| <= 1)
    big = max(t.abs().max().item() for t in (q, k))
    tol = dict(rtol=0,
               atol=3 * 2.0 ** -7 * big if dtype == torch.bfloat16 and device == "cpu" else 0.0)
    for a, b in ((out_q, ref_q), (caches[1], caches[0])):
        print(f"rope {device} {dtype} T={T}: "
              f"max |kernel - reference| {(a.float() - b.float()).abs().max().item():.3g}")
        torch.testing.assert_close(a, b, **tol)
    assert (out_q.shape == (B, HQ, T, D)
            and not torch.equal(caches[1][0][:, :, slots], k.transpose(1, 2)))  # rotated
    assert torch.equal(caches[1][1][:, :, slots], v.transpose(1, 2))           # v as it is
    others = torch.ones(S, dtype=torch.bool)
    others[slots.cpu()] = False
    # nothing else
    assert torch.equal(caches[1][:, :, :, others.to(device)], cache0[:, :, :, others.to(device)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [3, 12])
def test_rope_forward_and_backward_match_reference(device, dtype, heads):
    """ops.rope (the training path) against apply_rope under autograd: q as a transposed view of a
    padded fused output, heads fewer and more than a program's block of 8, real positions.
    Tolerances as in the test above."""
    g = torch.Generator().manual_seed(heads)
    B, T, D = 2, 5, 16
    y = torch.randn(B, T, heads * D + 8, generator=g).to(device, dtype)
    pos = torch.randint(0, 1000, (B, T), generator=g).float()
    emb = pos[..., None] * (1e4 ** -(torch.arange(0, D, 2) / D))
    cos, sin = (torch.cat((emb, emb), -1).cos()[:, None].to(device, dtype),
                torch.cat((emb, emb), -1).sin()[:, None].to(device, dtype))          # (B, 1, T, D)
    dy = torch.randn(B, heads, T, D, generator=g).to(device, dtype)
    outs = []
    for fn in (ops.rope, ops.apply_rope):
        x = y[..., :heads * D].detach().clone().requires_grad_(True)
        out = fn(x.view(B, T, heads, D).transpose(1, 2), cos, sin)             # (B, heads, T, D)
        (out.float() * dy.float()).sum().backward()
        outs.append((out.detach(), x.grad.view(B, T, heads, D).transpose(1, 2)))
    assert outs[0][0].shape == (B, heads, T, D)
    # forward: the same bits on the GPU
    for a, b, exact in zip(outs[0], outs[1], (device == "cuda", False)):
        big = max(t.abs().max().item() for t in (y, dy))
        tol = dict(rtol=0,
                   atol=0.0 if exact else 3 * 2.0 ** -7 * big if dtype == torch.bfloat16 else 1e-6)
        torch.testing.assert_close(a, b, **tol)


# --------------------------------------------------------------------------------------------------
# Clear errors

def test_errors():
    w, (packed, scale, gs) = make_weight(32, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        layout.pack_nvfp4(torch.zeros(4, 12, dtype=torch.uint8),
                          torch.zeros(4, 1, dtype=torch.float8_e4m3fn), gs)
    with pytest.raises(ValueError, match="uint8"):
        layout.pack_nvfp4(packed.float(), scale, gs)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        layout.pack_nvfp4(packed, scale.float(), gs)
    with pytest.raises(ValueError, match="expects K = 64"):
        K.nvfp4_linear(torch.zeros(2, 48, dtype=torch.bfloat16), w)
    with pytest.raises(TypeError, match="float tensor"):
        K.nvfp4_linear(torch.zeros(2, 64, dtype=torch.int32), w)
    with pytest.raises(TypeError, match="NVFP4Weight"):
        K.nvfp4_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed)
    bad = layout.NVFP4Weight(w.words.repeat_interleave(2, dim=-1)[..., ::2], w.scales,
                             w.global_scale, w.n, w.k)
    with pytest.raises(ValueError, match="contiguous"):
        K.nvfp4_linear(torch.zeros(2, 64, dtype=torch.bfloat16), bad)
    with pytest.raises(ValueError, match="bias"):
        K.nvfp4_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w, torch.zeros(31))
    with pytest.raises(ValueError, match="shape"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)
    # two slices a warp: wrong sums at one token (H100)
    with pytest.raises(ValueError, match="multiple of KS"):
        K.nvfp4_mm(torch.zeros(1, 64, dtype=torch.bfloat16), w,
                   config=dict(BM=1, BN=16, KS=8, num_warps=4))


# --------------------------------------------------------------------------------------------------
# Sampling

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V,temperature,chunks",
                         [(5000, 0.7, None), (5000, 0.7, 1), (151936, 1.0, None), (7, 1.3, None)])
def test_race_sample_matches_reference(device, V, temperature, chunks):
    """sampler.race_sample (race argmax + online logsumexp per chunk of a row, then a merge;
    default 3 and 38 chunks for V = 5000 and 151936) against race_sample_ref on the same noise: the
    same tokens (the first index on a tie across chunks), log-probs within fp32 rounding of a
    V-long sum; masked (-inf) logits never win, even against tiny noise."""
    g = torch.Generator().manual_seed(V)
    logits = (3 * torch.randn(4, V, generator=g)).to(device)
    logits[1, ::3] = float("-inf")
    e = torch.empty(4, V).exponential_(generator=g).to(device)
    # a masked logit with the largest race score but -inf
    e[1, 0] = 1e-30
    # a tie between chunks: the first index wins
    if V > 4200:
        logits[2], e[2] = float("-inf"), 1.0
        logits[2, [10, V - 10]] = 1.0
    tok, lp = sampler.race_sample(logits, e, temperature, chunks)
    tok_r, lp_r = sampler.race_sample_ref(logits, e, temperature)
    assert tok.dtype == torch.int64 and torch.equal(tok, tok_r)
    # two summation orders of V fp32 terms
    torch.testing.assert_close(lp, lp_r, rtol=1e-5, atol=1e-5)
    assert tok[1] % 3 != 0 and (lp <= 0).all() and (V < 4200 or tok[2] == 10)
    z = logits.float() / temperature
    torch.testing.assert_close(lp, torch.log_softmax(z, -1).gather(-1, tok[:, None])[:, 0],
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# layers/shrink.py: the decode step's LoRA A product in one launch

@pytest.mark.parametrize("M, Kdim, R", [(1, 256, 8), (5, 1000, 24), (16, 640, 96), (33, 300, 128),
                                        (70, 200, 16)])
def test_lora_shrink_against_reference(monkeypatch, M, Kdim, R):
    """The kernel (the reference would raise if the wrapper fell back to it) against fp32 math
    rounded once to bf16: K split over 1-2 programs (ragged last one at K = 640), tokens over 1-2
    blocks (M = 70), R up to 128. fp32 sums in another order, then one bf16 rounding (the CPU
    interpreter truncates it): 2 ulps. Twice the same bits (the last program adds the partial sums
    in program order), and the split-K counters back at 0."""
    from layers import shrink
    dev = DEVICES[0]
    g = torch.Generator().manual_seed(M * 1000 + R)
    x = torch.randn(M, Kdim, generator=g).to(dev, torch.bfloat16)
    A = (0.05 * torch.randn(R, Kdim, generator=g)).to(dev, torch.bfloat16)
    ref = shrink.lora_shrink_ref(x, A)

    def no_fallback(*a):
        raise AssertionError("lora_shrink fell back to the reference")
    monkeypatch.setattr(shrink, "lora_shrink_ref", no_fallback)
    got = shrink.lora_shrink(x, A)
    assert got.shape == (M, R) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -6, atol=1e-3)
    assert torch.equal(shrink.lora_shrink(x, A), got)
    assert int(layout._WS[x.device][1].sum()) == 0
    # the configs the benchmark times beside it (16-64 columns a step, 4-32 steps a program: K =
    # 1000 over 1-8 programs, the last ragged), within the same 2 ulps
    from bench.lora_speed import SHRINK_SWEEP
    for config in SHRINK_SWEEP:
        other = shrink.lora_shrink(x, A, config)
        torch.testing.assert_close(other.float(), ref.float(), rtol=2 ** -6, atol=1e-3)
        assert int(layout._WS[x.device][1].sum()) == 0


def test_a_product_is_the_shrink_up_to_16_tokens_unless_switched():
    """layers/shrink.a_product: lora_shrink up to 16 tokens by default, cuBLAS's x @ A^T above;
    NANOQERL_LORA_SHRINK=1 the shrink at every size, =0 never (read at import: fresh
    interpreters)."""
    import subprocess
    import sys
    code = """
import torch
from layers import shrink
calls = []
shrink.lora_shrink = lambda x, A, config=None: calls.append(x.shape[0]) or x @ A.t()
A = torch.randn(8, 64).to(torch.bfloat16)
for m in (1, 16, 17, 64):
    shrink.a_product(torch.randn(m, 64).to(torch.bfloat16), A)
print(calls)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for value, want in ((None, "[1, 16]"), ("1", "[1, 16, 17, 64]"), ("0", "[]")):
        env = {k: v for k, v in os.environ.items() if k != "NANOQERL_LORA_SHRINK"}
        if value is not None:
            env["NANOQERL_LORA_SHRINK"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True,
                             capture_output=True, text=True)
        assert out.stdout.strip().splitlines()[-1] == want, (value, out.stdout)


@pytest.mark.parametrize("M, H, R, res, noise", [(1, 256, 96, True, False),
                                                 (5, 200, 40, True, True),
                                                 (20, 384, 16, False, False),
                                                 (33, 136, 64, True, True),
                                                 (2, 640, 128, True, False)])
def test_rms_norm_lora_against_reference(monkeypatch, M, H, R, res, noise):
    """The RMSNorm with the next group's A product in its launch against ops.rms_norm_ref and
    fp32 math: tokens over 1-3 blocks, the columns over 1-3 programs (H = 640: 20 steps of 32, 7
    a program, the last program's range ragged; H = 200 and 136 not a multiple of the step), A's
    rows padded to the block (R = 40 -> 64), with and without the residual add and AQN noise. y
    and h: the sum of squares in another order moves rstd in its last bits, which can move a
    bf16 rounding by one ulp; the CPU interpreter truncates its bf16 casts (4 ulps there, as
    test_rms_norm_forward says). xa: fp32 sums in another order, then one bf16 rounding (2 ulps,
    as lora_shrink's)."""
    from layers import shrink
    dev = DEVICES[0]
    g = torch.Generator().manual_seed(M * 100 + R)
    x = torch.randn(M, H, generator=g).to(dev, torch.bfloat16)
    r = torch.randn(M, H, generator=g).to(dev, torch.bfloat16) if res else None
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dev, torch.bfloat16)
    z = (0.05 * torch.randn(H, generator=g)).to(dev) if noise else None
    A = (0.05 * torch.randn(R, H, generator=g)).to(dev, torch.bfloat16)
    y0, h0, xa0 = shrink.rms_norm_lora_ref(x, w, 1e-6, z, r, A)
    monkeypatch.setattr(shrink, "rms_norm", lambda *a: pytest.fail("fell back to two launches"))
    with torch.no_grad():
        y, h, xa = shrink.rms_norm_lora(x, w, 1e-6, z, r, A)
    ulp = 2.0 ** -7 if dev == "cuda" else 2.0 ** -5
    assert (h is None) == (r is None)
    for a, b in ((y, y0), (h, h0)) if r is not None else ((y, y0),):
        assert ((a.float() - b.float()).abs() <= ulp * b.float().abs() + 1e-6).all()
    assert xa.shape == (M, R) and xa.dtype == torch.bfloat16
    # xa is the product of the y it returned: fp32 sums, one rounding to bf16
    torch.testing.assert_close(xa.float(), shrink.lora_shrink_ref(y, A).float(), rtol=2 ** -6,
                               atol=1e-3)
    # and the reference's within what those few ulps of y move it (as a whole: an element near 0
    # has no relative tolerance)
    assert (xa.float() - xa0.float()).norm() <= 2 ** -6 * xa0.float().norm()
    # twice the same bits (the partial products added in program order), counters back at 0
    with torch.no_grad():
        again = shrink.rms_norm_lora(x, w, 1e-6, z, r, A)
    assert all(torch.equal(a, b) for a, b in zip(again, (y, h, xa)) if a is not None)
    assert int(layout._WS[x.device][1].sum()) == 0


@pytest.mark.parametrize("M, Kdim, R, gated", [(1, 512, 32, 0), (3, 128, 8, 0),
                                                (8, 640, 96, 0), (2, 384, 64, 100),
                                                (12, 512, 32, 0), (20, 640, 96, 100),
                                                (40, 256, 16, 0)])
def test_fused_a_product_gemm_against_two_launches(monkeypatch, M, Kdim, R, gated):
    """gemm/fused_a: the GEMM whose launch also makes xa = x @ A^T, against the two launches it
    replaces (lora_shrink_ref, then nvfp4_mm adding xa @ B^T in its epilogue): the K-sliced GEMM
    at 1-8 tokens, the split-K one at 12-40 (K split in 2 at 12 and 20: the tile's last split
    waits for xa; no split at 40), xa over 1-3 programs (K = 128 / 256-640: 1 / 1-3
    programs of 256 columns, the last one ragged at 640), R up to 128 (96 pads to 128), plain and
    gated (silu(gate) * up). xa's fp32
    sums come in another order and may round one bf16 ulp apart; then y moves by up to that ulp
    times |B| summed over R, on top of the output's own rounding. Twice the same bits; the ticket,
    flag and counters back at 0 after every launch."""
    from gemm import fused_a
    from layers import shrink
    dev = DEVICES[0]
    N = 256 if gated else 96
    w, _ = make_weight(N, Kdim, seed=M + R, device=dev)
    g = torch.Generator().manual_seed(M * 10 + R)
    x = torch.randn(M, Kdim, generator=g).to(dev, torch.bfloat16)
    A = (0.05 * torch.randn(R, Kdim, generator=g)).to(dev, torch.bfloat16)
    B = (0.1 * torch.randn(N, R, generator=g)).to(dev, torch.bfloat16)
    bias = None if gated else torch.randn(N, generator=g).to(dev, torch.bfloat16)
    if K.ws_choice(x, w, gated=gated) is not None:
        # on Hopper 40 tokens run the warp-specialized GEMM, which the fused launch leaves to the
        # two launches; with that GEMM's range moved past 64 tokens, the split-K one runs here too
        assert fused_a.nvfp4_mm_fused_a(x, w, A, B, bias, gated=gated) is None
        monkeypatch.setattr(K, "WS_MIN_M", fused_a.MAX_M)
    y = fused_a.nvfp4_mm_fused_a(x, w, A, B, bias, gated=gated)
    ref = fused_a.nvfp4_mm_fused_a_ref(x, w, A, B, bias, gated=gated)
    assert y is not None and y.shape == ref.shape == (M, gated or N) and y.dtype == torch.bfloat16
    xa = shrink.lora_shrink_ref(x, A).float()
    moved = 2.0 ** -7 * (xa.abs() @ B.float().abs().t())                # one xa ulp, through B
    if gated:
        moved = moved[:, :gated] + moved[:, N // 2:N // 2 + gated]      # through gate and up
    tol = ROUND[dev] * 2 * ref.float().abs() + 2 * moved + 1e-3
    assert ((y.float() - ref.float()).abs() <= tol).all(), (y.float() - ref.float()).abs().max()
    # the term is there
    plain = K.nvfp4_mm(x, w, bias, gated=gated)
    assert not torch.allclose(y.float(), plain.float(), atol=1e-2)
    assert torch.equal(fused_a.nvfp4_mm_fused_a(x, w, A, B, bias, gated=gated), y)
    assert int(fused_a._SYNC[x.device].abs().sum()) == 0
    assert int(layout._WS[x.device][1].sum()) == 0


def test_fused_a_product_gemm_declines_what_it_does_not_cover():
    # more than 64 tokens, or fp32: None, and the caller makes xa itself
    from gemm import fused_a
    dev = DEVICES[0]
    w, _ = make_weight(96, 256, device=dev)
    A = torch.randn(8, 256).to(dev, torch.bfloat16)
    B = torch.randn(96, 8).to(dev, torch.bfloat16)
    x = torch.randn(65, 256).to(dev, torch.bfloat16)
    assert fused_a.nvfp4_mm_fused_a(x, w, A, B) is None
    assert fused_a.nvfp4_mm_fused_a(x[:2].float(), w, A, B) is None


def test_the_lora_path_benchmark_costs_each_round_against_its_own_adapters_off_run():
    # bench rollout --lora-paths: a slow round (a busy GPU) must not count against one path, so
    # each round's cost is taken against the adapters-off run of that round, then the median.
    # Hand-made tok/s; costs by hand: cublas 0.2 / 0.1 / 0.3, shrink 0.1 / 0.04 / 0.08,
    # shrink+norm 0.05 / 0.02 / 0.04
    from bench.lora_speed import path_summary

    tok = {0: dict(off=100, cublas=80, shrink=90, norm=95),
           1: dict(off=50, cublas=45, shrink=48, norm=49),
           2: dict(off=100, cublas=70, shrink=92, norm=96)}
    names = dict(off="off", cublas="cublas", shrink="shrink", norm="shrink+norm")
    rows = [dict(batch=16, round=r, path=names[k], tok_s=v)
            for r, d in tok.items() for k, v in d.items()]
    got = path_summary(16, rows)
    assert got["rounds"] == 3
    assert got["cublas"]["cost"] == pytest.approx(0.2)
    assert got["shrink"]["cost"] == pytest.approx(0.08)
    assert got["shrink+norm"]["cost"] == pytest.approx(0.04)
    assert got["cublas"]["tok_s"] == 70


def test_the_lora_path_benchmark_refuses_zero_rounds_in_one_line(capsys):
    # before any GPU check: the same line on every machine
    from bench.__main__ import main

    assert main(["rollout", "--lora-paths", "--rounds", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rounds must be >= 1, got 0"
    assert main(["rollout", "--lora-paths", "--paths", "shrink,fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --paths fast: not a path; the paths are off, ")
    assert "\n" not in err
