"""linear.py: the decoder's linears: a frozen base (bf16 or NVFP4 through kernels.py), fused groups
(q/k/v, gate/up) as one GEMM, and the LoRA term each adds (the LoRA product that model.py and
lora.py both use).

y = base(x) + (dropout(x) @ A^T) @ B^T * scale: a Linear holds A (r, in) and B (out, r) as fp32
parameters once lora.py attaches them; the product runs in the activations' dtype, one A and one
block-diagonal B for a whole fused group (group_ab), accumulated into the base output in place
(add_term). While generating, the engine's snapshot of the adapters (lora.snapshot, the same
group_ab) rides in the NVFP4 GEMM's epilogue instead.
"""
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from gemm import fused_a, layout
from layers import shrink
from layers.ops import rms_norm, silu_mul


def group_ab(lins, pads, dtype):
    """The adapters of a fused group (or of one linear) as ONE product: A (R, in) stacks the
    members' A; B (rows, R) is block-diagonal with each member's B * scale, zero rows for the base's
    padding rows (pads: rows per member). Members without an active adapter add nothing.
    Differentiable. Returns None when no member has one."""
    on = [lin.lora_A is not None and lin.lora_on for lin in lins]
    if not any(on):
        return None
    A = torch.cat([lin.lora_A for lin, o in zip(lins, on) if o]).to(dtype)          # (R, in)
    R, roff, blocks = A.shape[0], 0, []
    for lin, p, o in zip(lins, pads, on):
        r = lin.lora_A.shape[0] if o else 0
        b = lin.lora_B * lin.lora_scale if o else A.new_zeros(lin.out_features, 0)  # (out, r)
        blocks.append(torch.nn.functional.pad(b, (roff, R - roff - r, 0, p - lin.out_features)))
        roff += r
    return A, torch.cat(blocks).to(dtype)                                           # (rows, R)


class _AddLoRA(torch.autograd.Function):
    """y += (x @ A^T) @ B^T in place: one GEMM accumulating into the base output (beta = 1, rounded
    once), so the adapter makes no (tokens, rows) temporaries. Backward: dy passes through to the
    base; dx = (dy @ B) @ A, dA = (dy @ B)^T @ x, dB = dy^T @ (x @ A^T)."""

    @staticmethod
    def forward(ctx, y, x, A, B):
        # y (M, N) not a view, x (M, K), A (R, K), B (N, R)
        xa = x @ A.t()                                               # (M, R)
        y.addmm_(xa, B.t())
        ctx.mark_dirty(y)
        ctx.save_for_backward(x, A, B, xa)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, A, B, xa = ctx.saved_tensors
        dxa = dy @ B                                                 # (M, R)
        dx = dxa @ A if ctx.needs_input_grad[1] else None
        dA = dxa.t() @ x if ctx.needs_input_grad[2] else None
        dB = dy.t() @ xa if ctx.needs_input_grad[3] else None
        return dy, dx, dA, dB


def add_term(y, x, ab):
    """y (M, N) + x (M, K) @ A^T @ B^T for ab = group_ab(...) (None: y). y must be a fresh tensor,
    not a view."""
    return y if ab is None else _AddLoRA.apply(y, x, *ab)


class Linear(nn.Module):
    """A frozen base linear, bf16 (`weight`) or NVFP4 (`words`, `scales`, `global_scale`, see
    layout.pack_nvfp4), plus an optional LoRA adapter that lora.py attaches (`lora_A` (r, in),
    `lora_B` (out, r), `lora_scale`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        for name in ("weight", "words", "scales", "global_scale", "bias"):
            self.register_buffer(name, None)
        self.has_bias = bias
        self.lora_A = self.lora_B = None
        self.lora_scale, self.lora_dropout, self.lora_on = 0.0, 0.0, True
        # the engine's generation snapshot of the adapter (lora.snapshot), set only while generating
        self.snap = None

    def qweight(self) -> layout.NVFP4Weight:
        return layout.NVFP4Weight(self.words, self.scales, self.global_scale,
                                   self.out_features, self.in_features)

    def forward(self, x, xa=None):
        # (..., in) -> (..., out); xa: the snapshot's A product, made by the launch before (next_a)
        x2 = x.reshape(-1, self.in_features)                                  # (M, in)
        y = base_linear(self, x2, self.qweight() if self.words is not None else None, xa=xa)
        if self.snap is None:
            y = lora_term([self], [self.out_features], x2, y, self.training)
        return y.view(*x.shape[:-1], -1)


def lora_term(lins, pads, x2, y, training):
    """y (M, rows) + the LoRA term of lins (one linear, or the members of a fused group with their
    row counts): one A and one block-diagonal B for the whole group (group_ab), accumulated into y
    in place. With dropout while training, each member draws its own mask, as PEFT does (one member
    at a time, out of place)."""
    active = [lin for lin in lins if lin.lora_A is not None and lin.lora_on]
    if not (training and any(lin.lora_dropout for lin in active)):
        return add_term(y, x2, group_ab(lins, pads, x2.dtype))
    outs, off = [], 0
    for lin, p in zip(lins, pads):
        o = y[:, off:off + p]
        if lin.lora_A is not None and lin.lora_on:
            h = F.dropout(x2, lin.lora_dropout, training)
            t = (h @ lin.lora_A.t().to(x2.dtype)) @ lin.lora_B.t().to(x2.dtype) * lin.lora_scale
            o = o + F.pad(t, (0, p - lin.out_features))
        outs.append(o)
        off += p
    return torch.cat(outs, 1)


def epilogue_path(qw, x) -> bool:
    """Whether generation runs this NVFP4 linear through kernels.nvfp4_mm, whose epilogue adds the
    LoRA snapshot (and, for gate_up, can apply SiLU x up): Triton, bf16, no autograd, fewer than
    LARGE_M tokens."""
    return qw is not None and kernels._use_triton(x) and x.dtype == torch.bfloat16 \
        and x.shape[0] < kernels.LARGE_M and not torch.is_grad_enabled()


def base_linear(mod, x, qw, gated: int = 0, xa=None):
    """x (M, in) -> (M, rows), a fresh tensor: the frozen base, NVFP4 through kernels (on CPU the
    reference, with the dequantized weight cached) or bf16, plus the generation snapshot of its LoRA
    (mod.snap, lora.snapshot): added in the NVFP4 GEMM's epilogue where that runs, else accumulated
    in place like the training adapters (add_term). gated=n (epilogue path only): silu(gate) * up
    (M, n) of a fused gate_up instead (kernels.nvfp4_mm). xa: the snapshot's A product (M, R), when
    the norm before already made it (norm_for), else None."""
    if qw is not None and not qw.words.is_cuda and not kernels.CPU_TRITON:
        if getattr(mod, "_deq", None) is None:
            mod._deq = kernels.dequantize_ref(qw, x.dtype)
        y = F.linear(x, mod._deq.to(x.dtype), None if mod.bias is None else mod.bias.to(x.dtype))
    elif (mod.snap is not None or gated) and epilogue_path(qw, x):
        x = x.contiguous()
        if xa is None and mod.snap is not None:
            # up to 64 tokens: the A product inside the GEMM's launch (gemm/fused_a), opt-in
            if shrink.FUSED and (y := fused_a.nvfp4_mm_fused_a(x, qw, *mod.snap, mod.bias,
                                                                gated)) is not None:
                return y
            xa = shrink.a_product(x, mod.snap[0])                           # (M, R)
        snap = None if mod.snap is None else (xa, mod.snap[1])
        return kernels.nvfp4_mm(x, qw, mod.bias, lora=snap, gated=gated)
    elif qw is not None:
        y = kernels.nvfp4_linear(x, qw, mod.bias)
    else:
        y = F.linear(x, mod.weight, mod.bias)
    return add_term(y, x, mod.snap)


class Fused(nn.Module):
    """q/k/v (or gate/up) as ONE base GEMM: their rows concatenated (NVFP4 rows concatenate because
    the group shares one global scale). The member Linears keep views of their rows (for export) and
    their LoRA."""

    def __init__(self, lins):
        super().__init__()
        nv = lins[0].words is not None
        # NVFP4 rows are padded to 128
        self.pads = [lin.words.shape[1] if nv else lin.out_features for lin in lins]
        self.in_features, self.n = lins[0].in_features, sum(self.pads)
        cat = lambda ts, dim: torch.cat(ts, dim)  # noqa: E731
        self.register_buffer("words", cat([lin.words for lin in lins], 1) if nv else None)
        self.register_buffer("scales", cat([lin.scales for lin in lins], 1) if nv else None)
        self.register_buffer("global_scale", lins[0].global_scale if nv else None)
        self.register_buffer("weight", None if nv else cat([lin.weight for lin in lins], 0))
        self.register_buffer("bias", None)
        self.snap = None
        if lins[0].bias is not None:
            padded = [F.pad(lin.bias, (0, p - lin.out_features)) for lin, p in zip(lins, self.pads)]
            self.bias = cat(padded, 0)
        off = 0
        for lin, p in zip(lins, self.pads):  # views, not copies
            if nv:
                lin.words, lin.scales = self.words[:, off:off + p], self.scales[:, off:off + p]
            else:
                lin.weight = self.weight[off:off + p]
            off += p

    def qw(self):
        if self.words is None:
            return None
        return layout.NVFP4Weight(self.words, self.scales, self.global_scale,
                                   self.n, self.in_features)

    def forward(self, x, lins, raw: bool = False, xa=None):
        # -> one output per member (xa: the snapshot's A product, made by the norm before)
        x2 = x.reshape(-1, self.in_features)                                  # (M, in)
        y = base_linear(self, x2, self.qw(), xa=xa)                           # (M, rows)
        if self.snap is None:
            y = lora_term(lins, self.pads, x2, y, self.training)
        y, outs, off = y.view(*x.shape[:-1], -1), [], 0
        if raw:
            # (..., rows), members at self.pads
            return y
        for lin, p in zip(lins, self.pads):
            outs.append(y[..., off:off + lin.out_features])
            off += p
        return outs


def fuse(mod, names) -> None:
    lins = [getattr(mod, n) for n in names]
    nvfp4 = all(lin.words is not None for lin in lins)
    same = nvfp4 and all(torch.equal(lin.global_scale, lins[0].global_scale) for lin in lins)
    if same or all(lin.weight is not None for lin in lins):
        mod.fused = Fused(lins)


def project(mod, names, x, xa=None):
    """The member projections of a fused group in one GEMM (see Fused), or one by one. xa: the
    group's snapshot A product from norm_for, or None."""
    lins = [getattr(mod, n) for n in names]
    fused = getattr(mod, "fused", None)
    return fused(x, lins, xa=xa) if fused is not None else [lin(x) for lin in lins]


def norm_for(mod, x, weight, eps: float, noise, residual):
    """The RMSNorm before mod's fused group (q/k/v or gate/up): ops.rms_norm, whose output the
    group reads. Where that group's generation snapshot will ride in its GEMM's epilogue and
    shrink.NORM is on, the norm also makes the snapshot's A product in its own launch
    (shrink.rms_norm_lora). Returns (y, h = x + residual or None without residual, xa or None)."""
    fused = getattr(mod, "fused", None)
    if shrink.NORM and fused is not None and fused.snap is not None \
            and epilogue_path(fused.qw(), x.reshape(-1, x.shape[-1])):
        return shrink.rms_norm_lora(x, weight, eps, noise, residual, fused.snap[0])
    out = rms_norm(x, weight, eps, noise, residual)
    y, h = out if residual is not None else (out, None)
    return y, h, None


def next_a(lin, x2):
    """The A (R, in) of lin's generation snapshot where the launch before lin may make its A product
    (shrink.ATTN: the decode attention, for o_proj): lin's snapshot rides in its GEMM's epilogue for
    rows like x2 (M, any: device, dtype and count); else None."""
    qw = lin.qweight() if lin.words is not None else None
    if shrink.ATTN and lin.snap is not None and epilogue_path(qw, x2):
        return lin.snap[0]
    return None


def mlp_act(mlp, x, n: int, xa=None):
    """silu(gate) * up (..., n). Where generation runs the fused gate_up through the Triton GEMMs
    and its LoRA, if any, is the snapshot: in that GEMM's epilogue (one launch less a layer; same
    bits). Else gate and up side by side (the fused output as it is, both members padded alike, or
    the two outputs concatenated), then ops.silu_mul."""
    fused, lins = getattr(mlp, "fused", None), [mlp.gate_proj, mlp.up_proj]
    x2 = x.reshape(-1, x.shape[-1])
    if fused is None:
        gu = torch.cat([lin(x) for lin in lins], -1)                           # (..., 2 n)
        return silu_mul(gu, n, n)
    qw, lora_on = fused.qw(), any(lin.lora_A is not None and lin.lora_on for lin in lins)
    few = x2.shape[0] <= kernels.GATED_MAX_M
    alike = fused.pads[0] == fused.pads[1]
    if few and epilogue_path(qw, x2) and alike and (fused.snap is not None or not lora_on):
        return base_linear(fused, x2, qw, gated=n, xa=xa).view(*x.shape[:-1], n)
    # (..., rows): gate, then up
    gu = fused(x, lins, raw=True, xa=xa)
    return silu_mul(gu, n, gu.shape[-1] // 2)
