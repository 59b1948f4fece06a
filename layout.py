"""layout.py: the kernel layout of an NVFP4 weight (what kernels.py and kernels_ws.py read), built once at load.

    pack_nvfp4(weight_packed, weight_scale, weight_global_scale) -> NVFP4Weight   checkpoint -> kernel words
    unpack_codes(w)                                                               and back (for the references)

The checkpoint (compressed-tensors) holds 4-bit e2m1 codes two a byte, one fp8 e4m3 scale per 16 weights and an fp32
global scale. The kernels read tile-major 32-bit words whose bits sit where a few integer operations turn them into
bf16 lanes (ROT; kernels.py's docstring says why that is exact). Leaves out: any other packing (FP4 activations,
MX formats).
"""
import functools
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


# Bit placement in a word, per block slot o (blocks r = o and r = 4 + o of a tile go to the two words of a column
# pair): magnitude bit i of lane j (column 2p + j) sits at bit (6 + 16 j + i + ROT[o][0]) % 32, the sign at
# (15 + 16 j + ROT[o][1]) % 32, so rotating right by ROT[o] puts them where a bf16 lane wants them (bits 8..6, 15).
ROT = ((0, 0), (3, 3), (6, 1), (13, 2))


@functools.cache  # built once per device: a host-to-device copy is not allowed inside a CUDA graph capture
def _bit_positions(device) -> torch.Tensor:
    """(4 slots, 2 lanes, 4 code bits) -> word bit position; code bits 0..2 magnitude, 3 sign."""
    pos = [[[(6 + 16 * j + i + ROT[o][0]) % 32 for i in range(3)] + [(15 + 16 * j + ROT[o][1]) % 32]
            for j in range(2)] for o in range(4)]
    return torch.tensor(pos, dtype=torch.int64, device=device)


def pack_nvfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor) -> NVFP4Weight:
    """(N, K/2) uint8 codes (even k low nibble), (N, K/16) fp8 scales, (1,) fp32 -> NVFP4Weight.

    Words: (tile t, row n, 16); k = 128 t + 16 r + c (block r = 0..7, column c = 0..15); word 2p + h holds blocks
    r = 4h + o (o = 0..3) of columns 2p, 2p+1 at the bit positions of ROT. Zero padding (to 128) is inert.
    """
    if weight_packed.dtype != torch.uint8 or weight_packed.dim() != 2:
        raise ValueError(f"weight_packed must be a 2-D uint8 tensor, got {weight_packed.dtype} {tuple(weight_packed.shape)}")
    N, K = weight_packed.shape[0], weight_packed.shape[1] * 2
    if K % 16:
        raise ValueError(f"NVFP4 needs K to be a multiple of 16, got K = {K}")
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (N, K // 16):
        raise ValueError(f"weight_scale must be float8_e4m3fn of shape {(N, K // 16)}, got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale must hold one value, got shape {tuple(global_scale.shape)}")
    dev = weight_packed.device
    Np, Kp = -(-N // 128) * 128, -(-K // 128) * 128
    p = weight_packed.contiguous()
    codes = torch.zeros(Np, Kp, dtype=torch.int64, device=dev)
    codes[:N, :K] = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(N, K).to(torch.int64)
    c = codes.view(Np, Kp // 128, 2, 4, 8, 2)                        # (n, t, h, o, p, j): r = 4h + o, col 2p + j
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
    words = (w.words.to(torch.int64) & 0xFFFFFFFF).reshape(KT, Np, 8, 2).permute(1, 0, 3, 2)  # (n, t, h, p)
    pos = _bit_positions(words.device)                                  # (o, j, bit)
    bits = (words[:, :, :, None, :, None, None] >> pos[None, None, None, :, None, :, :]) & 1
    codes = (bits << torch.arange(4, device=words.device)).sum(-1)     # (n, t, h, o, p, j)
    return codes.reshape(Np, KT * 128)
