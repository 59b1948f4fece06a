"""configs.py: the tile configs of kernels.py's NVFP4 GEMM per token bucket, tuned on an H100, and
how a split of K runs (kernels.nvfp4_mm picks them; the warp-specialized GEMM has its own,
warp_specialized.ws_config).

    python -m bench kernels --sweep       # the measurements behind every branch (docs/KERNELS.md)

Leaves out: tuning for GPUs other than Hopper (their portable path runs these configs too).
"""


def mm_config(M: int, N: int, K: int, sms: int = 132, sliced: bool = True) -> dict:
    """Tile config for M tokens, from `python -m bench kernels --sweep` on an H100 (the branches'
    comments say why; docs/KERNELS.md has the measurements). Up to 8 tokens (sliced=True): the
    K-sliced kernel, 4 slices on 4 warps, 16 weight rows (32 where row tiles are many). Else BM
    covers the tokens (the tensor cores' N side) and BN the weight rows: at M <= 64 (bandwidth- and
    latency-bound) K is split until enough programs per SM hide the latency (7 at M <= 16, 2.5 up
    to 64, each split >= 2 K tiles; at 17..64 tokens a long K up to one wave of 3 an SM, >= 16 K
    tiles each); above 64 (compute-bound) wave quantization picks the tile. PEEL (the first K tile
    outside the loop: ptxas keeps the wgmmas in flight) pays above 16 tokens with >= 8 K tiles per
    split."""
    KT, cdiv = -(-K // 128), lambda a, b: -(-a // b)
    if sliced and M <= 8:
        BN = 32 if cdiv(N, 16) >= 8 * sms else 16
        return dict(BM=1 << (M - 1).bit_length(), BN=BN, KS=4, num_warps=4, num_stages=4)
    t128 = cdiv(N, 128) * cdiv(M, 128)
    if M <= 64:
        BM, BN, warps, stages, fill = ((16 if M <= 16 else 32 if M <= 32 else 64), 64, 4, 3,
                                       (7.0 if M <= 16 else 2.5))
        # few tokens, and 64-row tiles would split K: 128 rows pay
        if M <= 8 and cdiv(N, 64) * 2 <= fill * sms:
            BN = 128
    elif KT >= 64 and t128 * 2 <= sms:            # long K, few tiles: split K over one wave
        BM, BN, warps, stages, fill = 128, 128, 8, 4, 1.0
    elif t128 >= 0.75 * cdiv(t128, sms) * sms:    # 128 x 128 tiles fill their waves
        BM, BN, warps, stages, fill = 128, 128, 8, 4, 0.0
    elif cdiv(N, 64) * cdiv(M, 128) <= sms:       # 128 x 64 tiles: one wave, one program per SM
        BM, BN, warps, stages, fill = 128, 64, 4, 3, 1.0
    else:
        BM, BN, warps, stages, fill = 64, 64, 4, 3, 0.0
    tiles = cdiv(N, BN) * cdiv(M, BM)
    split = 1
    while split < 16 and tiles * split * 2 <= fill * sms and KT // (split * 2) >= 2:
        split *= 2
    # long K (down): split up to one full wave (3 programs per SM) while a split keeps >= 16 K tiles
    if 16 < M <= 64:
        split = max(split, min(3 * sms // tiles, KT // 16))
    peel = int(M > 16 and split_k(KT, split)[1] >= 8)
    return dict(BM=BM, BN=BN, SPLIT_K=split, num_warps=warps, num_stages=stages, PEEL=peel)


def split_k(KT: int, split: int) -> tuple[int, int]:
    """The split count that runs for KT tiles of K asked to split `split` ways, and its tiles per
    split (every split gets >= 1 tile: 28 tiles asked for 8 splits run as 7 of 4)."""
    per = -(-KT // min(split, KT))
    return -(-KT // per), per
