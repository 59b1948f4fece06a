"""layout.py: the kernel layout of an NVFP4 weight (what kernels.py and warp_specialized.py read),
built once at load.

    pack_nvfp4(weight_packed, weight_scale, weight_global_scale) -> NVFP4Weight
                                   checkpoint -> kernel words
    unpack_codes(w)                and back (for the references)
    scale_ptx, code_ptx, bits_ptx  the PTX that turns words into bf16 (both GEMMs inline it)
    lora_args, workspace           the LoRA epilogue's operands, the split-K workspace (both GEMMs)

The checkpoint (compressed-tensors) holds 4-bit e2m1 codes two a byte, one fp8 e4m3 scale per 16
weights and an fp32 global scale. The kernels read tile-major 32-bit words whose bits sit where a
few integer operations turn them into bf16 lanes (ROT; kernels.py's docstring says why that is
exact). Leaves out: any other packing (FP4 activations, MX formats).
"""
import functools
import os
from typing import NamedTuple

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class NVFP4Weight(NamedTuple):
    """A frozen NVFP4 linear weight in the kernel layout (see pack_nvfp4). n, k: the true shape."""
    words: torch.Tensor         # (Kp/128, Np, 16) int32, Np and Kp rounded up to multiples of 128
    scales: torch.Tensor        # (Kp/128, Np, 2) int32: the 8 fp8 block scales of a row's tile
    global_scale: torch.Tensor  # (1,) fp32, the divisor
    n: int
    k: int


# Bit placement in a word, per block slot o (blocks r = o and r = 4 + o of a tile go to the two
# words of a column pair): magnitude bit i of lane j (column 2p + j) sits at bit
# (6 + 16 j + i + ROT[o][0]) % 32, the sign at (15 + 16 j + ROT[o][1]) % 32, so rotating right by
# ROT[o] puts them where a bf16 lane wants them (bits 8..6, 15).
ROT = ((0, 0), (3, 3), (6, 1), (13, 2))


# built once per device: a host-to-device copy is not allowed inside a CUDA graph capture
@functools.cache
def _bit_positions(device) -> torch.Tensor:
    """(4 slots, 2 lanes, 4 code bits) -> word bit position; code bits 0..2 magnitude, 3 sign."""
    pos = [[[(6 + 16 * j + i + ROT[o][0]) % 32 for i in range(3)] + [(15 + 16 * j + ROT[o][1]) % 32]
            for j in range(2)] for o in range(4)]
    return torch.tensor(pos, dtype=torch.int64, device=device)


def pack_nvfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               global_scale: torch.Tensor) -> NVFP4Weight:
    """(N, K/2) uint8 codes (even k low nibble), (N, K/16) fp8 scales, (1,) fp32 -> NVFP4Weight.

    Words: (tile t, row n, 16); k = 128 t + 16 r + c (block r = 0..7, column c = 0..15); word 2p + h
    holds blocks r = 4h + o (o = 0..3) of columns 2p, 2p+1 at the bit positions of ROT. Zero padding
    (to 128) is inert.
    """
    if weight_packed.dtype != torch.uint8 or weight_packed.dim() != 2:
        raise ValueError(f"weight_packed must be a 2-D uint8 tensor, got {weight_packed.dtype} "
                         f"{tuple(weight_packed.shape)}")
    N, K = weight_packed.shape[0], weight_packed.shape[1] * 2
    if K % 16:
        raise ValueError(f"NVFP4 needs K to be a multiple of 16, got K = {K}")
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (N, K // 16):
        raise ValueError(f"weight_scale must be float8_e4m3fn of shape {(N, K // 16)}, "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale must hold one value, got shape {tuple(global_scale.shape)}")
    dev = weight_packed.device
    Np, Kp = -(-N // 128) * 128, -(-K // 128) * 128
    p = weight_packed.contiguous()
    codes = torch.zeros(Np, Kp, dtype=torch.int64, device=dev)
    codes[:N, :K] = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(N, K).to(torch.int64)
    c = codes.view(Np, Kp // 128, 2, 4, 8, 2)  # (n, t, h, o, p, j): r = 4h + o, col 2p + j
    bits = (c[..., None] >> torch.arange(4, device=dev)) & 1           # (n, t, h, o, p, j, bit)
    pos = _bit_positions(dev)[None, None, None, :, None, :, :]           # (o, j, bit) -> position
    words = (bits << pos).sum(dim=(3, 5, 6))                           # (n, t, h, p)
    words = words.permute(1, 0, 3, 2).reshape(Kp // 128, Np, 16)       # word 2p + h
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    sc = torch.zeros(Np, Kp // 16, dtype=torch.uint8, device=dev)
    sc[:N, :K // 16] = weight_scale.view(torch.uint8)
    scales = sc.view(Np, Kp // 128, 8).permute(1, 0, 2).contiguous().view(torch.int32)  # (t, n, 2)
    gs = global_scale.reshape(1).to(device=dev, dtype=torch.float32)
    return NVFP4Weight(words.contiguous(), scales, gs, N, K)


def unpack_codes(w: NVFP4Weight) -> torch.Tensor:
    """Inverse of the word layout: (Np, Kp) int64 codes."""
    KT, Np = w.words.shape[0], w.words.shape[1]
    words = (w.words.to(torch.int64) & 0xFFFFFFFF).reshape(KT, Np, 8, 2)  # (t, n, p, h)
    words = words.permute(1, 0, 3, 2)                                      # (n, t, h, p)
    pos = _bit_positions(words.device)                                  # (o, j, bit)
    bits = (words[:, :, :, None, :, None, None] >> pos[None, None, None, :, None, :, :]) & 1
    codes = (bits << torch.arange(4, device=words.device)).sum(-1)     # (n, t, h, o, p, j)
    return codes.reshape(Np, KT * 128)


# --------------------------------------------------------------------------------------------------
# What both GEMMs share (kernels.py's Triton kernels, warp_specialized.py's Gluon one), here so that
# neither imports the other for it: the PTX that turns words into bf16, the LoRA epilogue's operands
# and the split-K workspace.

# Triton's CPU interpreter: it runs no PTX and no Gluon
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def mul_ptx(d: str, a: str, b: str, portable: bool) -> str:
    """d = a * b on two bf16 lanes, rounded once. mul.rn.bf16x2 needs sm_90 (Hopper); the portable
    form (sm_80 on: Ampere, Ada, Blackwell) is an fma adding -0.0, register nz: the same bits, as
    x + (-0.0) = x for every x, +0.0 included, and the fma rounds the exact product once, as the
    multiply does."""
    return f"fma.rn.bf16x2 {d}, {a}, {b}, nz;" if portable else f"mul.rn.bf16x2 {d}, {a}, {b};"


def _nz(portable: bool) -> str:
    # the -0.0 pair that the portable multiply adds
    return " .reg .b32 nz; mov.b32 nz, 0x80008000;" if portable else ""


def scale_ptx(portable: bool) -> str:
    """Per row: the two words holding a K tile's 8 fp8 block scales ($8, $9) -> 8 bf16x2 multipliers
    (s_r * 2^7, s_r * 2^7) ($0..$7): each scale byte shifted left by 4 is s * 2^-120 as a bf16,
    times 2^127."""
    muls = " ".join(mul_ptx(f"p{i}", f"p{i}", "c", portable) for i in range(4))
    return f"""{{
    .reg .b32 p<4>, c; .reg .b16 h<8>;{_nz(portable)}
    mov.b32 c, 0x7F007F00;
    prmt.b32 p0, $8, 0, 0x5140; prmt.b32 p1, $8, 0, 0x5342;
    prmt.b32 p2, $9, 0, 0x5140; prmt.b32 p3, $9, 0, 0x5342;
    shl.b32 p0, p0, 4; shl.b32 p1, p1, 4; shl.b32 p2, p2, 4; shl.b32 p3, p3, 4;
    {muls}
    mov.b32 {{h0, h1}}, p0; mov.b32 {{h2, h3}}, p1; mov.b32 {{h4, h5}}, p2; mov.b32 {{h6, h7}}, p3;
    mov.b32 $0, {{h0, h0}}; mov.b32 $1, {{h1, h1}}; mov.b32 $2, {{h2, h2}}; mov.b32 $3, {{h3, h3}};
    mov.b32 $4, {{h4, h4}}; mov.b32 $5, {{h5, h5}}; mov.b32 $6, {{h6, h6}}; mov.b32 $7, {{h7, h7}};
    }}"""


def bits_ptx(w: str, o: int) -> str:
    """Word w -> t0: the bf16x2 bits (sign, magnitude) of block slot o, by ROT[o] (t1 scratch)."""
    a, b = ROT[o]
    mag = f"shf.r.wrap.b32 t0, {w}, {w}, {a};" if a else f"mov.b32 t0, {w};"
    if a == b:
        return mag + " and.b32 t0, t0, 0x81C081C0;"
    return mag + (f" shf.r.wrap.b32 t1, {w}, {w}, {b}; and.b32 t1, t1, 0x80008000;"
                  f" lop3.b32 t0, t0, 0x01C001C0, t1, 0xEA;")


def code_ptx(portable: bool) -> str:
    """A pair of words (columns 2p, 2p+1: $8 blocks 0-3, $9 blocks 4-7) -> 8 bf16x2 registers $0..$7
    (block r = 4h + o), each times its multiplier $10 + 2r."""
    body = "".join(bits_ptx(w, o) + " "
                   + mul_ptx(f"${4 * h + o}", "t0", f"${10 + 2 * (4 * h + o)}", portable) + "\n"
                   for h, w in ((0, "$8"), (1, "$9")) for o in range(4))
    return "{\n.reg .b32 t<2>;" + _nz(portable) + "\n" + body + "}"


def lora_args(x2: torch.Tensor, w: NVFP4Weight, lora):
    """(xa, B, R) of lora=(xa (M, R), contiguous B (N, R)), R <= 128, checked; (x2, x2, 0)
    without one."""
    if lora is None:
        return x2, x2, 0
    (xa, lb), R = lora, lora[0].shape[-1]
    if xa.shape != (x2.shape[0], R) or lb.shape != (w.n, R) or R > 128 or not lb.is_contiguous():
        raise ValueError(f"lora must be xa (M, R) and contiguous B (N, R), R <= 128; "
                         f"got {tuple(xa.shape)}, {tuple(lb.shape)}")
    return xa.contiguous(), lb, R


# device -> (workspace fp32, tile counters int32); counters reset themselves after each use
_WS: dict = {}


def workspace(device, floats: int, tiles: int):
    """Split-K programs park partial sums here (floats) and count per output tile (tiles) who
    finishes last."""
    ws, cnt = _WS.get(device, (None, None))
    if ws is None or ws.numel() < floats:
        ws = torch.empty(max(floats, 1 << 20), dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < tiles:
        cnt = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    _WS[device] = (ws, cnt)
    return ws, cnt
