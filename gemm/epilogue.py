"""epilogue.py: what the Triton NVFP4 GEMMs (kernels.py, gemm/fused_a.py) do around their main
loops: which weight rows a program takes (_rows), the split-K fix-up (_fixup: partial sums parked
in a workspace, the tile's last split adds them in split order), and the store (_store: + bias,
+ the LoRA term xa @ B^T, SiLU x up for a fused gate_up, one rounding). _dot is the tensor-core
product both sides use, in fp32 under the CPU interpreter.

    pytest tests/test_kernels.py -k "lora or gated or split"     # through the GEMMs that use them
"""
try:  # (kernels.py checks the version; this file has nothing to offer without Triton)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _dot(a, b, acc, USE_ASM: tl.constexpr):
        if USE_ASM:
            return tl.dot(a, b, acc)
        else:  # the interpreter multiplies bf16 operands wrongly; fp32 is exact for these values
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)

    @triton.jit
    def _rows(pid_n, BN: tl.constexpr, UP, GATED: tl.constexpr):
        # a program's BN weight rows: consecutive, or (GATED) BN / 2 gate rows c and the up rows
        # UP + c beside them
        j = tl.arange(0, BN)
        if GATED:
            return pid_n * (BN // 2) + j % (BN // 2) + tl.where(j < BN // 2, 0, UP)
        return pid_n * BN + j

    @triton.jit
    def _store(acc, n, m, M, N, b_ptr, xa_ptr, lb_ptr, y_ptr, stride_ym, R, HAS_BIAS: tl.constexpr,
               RP: tl.constexpr, USE_ASM: tl.constexpr, GATED: tl.constexpr, I):
        # y = acc (BN, BM) fp32 + bias + the LoRA term B @ xa^T (xa = x @ A^T: (M, R), B: (N, R),
        # R <= RP), rounded once
        # GATED (rows as _rows): y = silu(gate) * up (M, I) of that rounded output, rounded as
        # ops.silu_mul does
        if RP > 0:
            r = tl.arange(0, RP)
            bt = tl.load(lb_ptr + n[:, None] * R + r[None, :],
                         mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
            # from L2 (.cg): gemm/fused_a writes xa in the same launch
            xa = tl.load(xa_ptr + m[None, :] * R + r[:, None], cache_modifier=".cg",
                         mask=(m[None, :] < M) & (r[:, None] < R), other=0.0)       # (RP, BM)
            acc = _dot(bt, xa, acc, USE_ASM)                                        # (BN, BM)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        dt = y_ptr.dtype.element_ty
        # the (BN, BM) tile is gate rows c, then up rows UP + c (_rows): store (BN/2, BM) at
        # columns c
        if GATED:
            h: tl.constexpr = n.shape[0] // 2
            g, u = tl.split(tl.permute(tl.reshape(acc.to(dt).to(tl.float32), (2, h, m.shape[0])),
                                       (1, 2, 0)))
            c, _ = tl.split(tl.permute(tl.reshape(n, (2, h)), (1, 0)))                  # (BN/2,)
            acc, n, N = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u, c, I
        tl.store(y_ptr + m[None, :] * stride_ym + n[:, None], acc.to(dt),
                 mask=(n[:, None] < N) & (m[None, :] < M))

    @triton.jit
    def _fixup(acc, n, m, M, N, ws_ptr, cnt_ptr, pid_n, pid_m, pid_k, NTN, NTM,
               SPLIT_K: tl.constexpr):
        # split K: park the partial sum; the last split of the output tile adds them all up in
        # split order. Returns (the tile's sum where this is the last split, whether it is)
        last = True
        if SPLIT_K > 1:
            tile = pid_m * NTN + pid_n
            mp = NTM * m.shape[0]                                               # padded tokens
            out_mask = (n[:, None] < N) & (m[None, :] < M)
            tl.store(ws_ptr + (pid_k * mp + m[None, :]) * N + n[:, None], acc, mask=out_mask)
            tl.debug_barrier()
            last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
            if last:
                acc = tl.zeros(acc.shape, dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    acc += tl.load(ws_ptr + (s * mp + m[None, :]) * N + n[:, None],
                                   mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # no fence: next launch sees it
        return acc, last
