"""quantize.py: a Hugging Face bf16/fp16/fp32 checkpoint -> an NVFP4 checkpoint in the
compressed-tensors layout.

    python quantize.py --model Qwen/Qwen2.5-7B-Instruct        # writes ./Qwen2.5-7B-Instruct-NVFP4
    python quantize.py --model path/to/hf_folder --out DIR --device cuda

The output loads unchanged in vLLM and in transformers (through the compressed-tensors library),
and in our model.py. Every decoder Linear (q/k/v/o, gate/up/down) becomes, for a weight W of
shape (N, K):
    global_scale = 448 * 6 / amax(|W|)   fp32, one per tensor; q/k/v share one, gate/up share one
    s_blk = fp8_e4m3(min(global_scale * amax_blk / 6, 448))   one per block of 16 along K
    q     = round_e2m1(clamp(W / (s_blk / global_scale), -6, 6))   nearest, ties to even
    W_hat = q * (s_blk / global_scale)
stored as `weight_packed` uint8 (N, K/2) (element 2j in the LOW nibble), `weight_scale`
float8_e4m3fn (N, K/16) and `weight_global_scale` float32 (1,). Embeddings, norms, biases and
lm_head stay bf16 (lm_head is in `ignore`).
A Linear whose K is not a multiple of 16 cannot be blocked: it stays bf16 and is listed in
`ignore` (with a note).

Streaming: tensors are read and written a few rows at a time with plain file I/O (no mmap,
util/tensorfile.py), so peak host memory is bounded by `--chunk-mb` working buffers, not by the
model size (measured in tests/test_quantize.py).
Output is written to a temporary folder beside --out and renamed at the end: an interrupted run
leaves nothing. An --out that cannot be written, a --chunk-mb or --shard-mb that is not > 0, are
refused before any tensor is read. Every file of the folder besides the weights is copied, so a
small model's recipe.json (pretrain.py), and the RL defaults in it, travel with its NVFP4 copy.

Leaves out: activation quantization (weights only: the H100 runs W4A16), calibrated or searched
scales (plain amax), MoE experts and vision towers.
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from util import fsutil, tensorfile

SUPPORTED_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
         "gate_proj": "gate_up", "up_proj": "gate_up"}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_MAX, FP4_MAX, BLOCK = 448.0, 6.0, 16

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                    "strategy": "tensor_group", "dynamic": False},
        "input_activations": None,
    }},
}


class QuantizeError(Exception):
    """A bad input, reported as one line by the CLI."""


# --------------------------------------------------------------------------------------------------
# NVFP4 math (used by the CLI, by model.py's quantize-on-load and by the kernel references)

def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already clamped to [-6, 6] -> 4-bit E2M1 codes (uint8): bit 3 sign, bits 0-2
    magnitude index.

    Nearest value, ties to the even index: thresholds 0.25 0.75 1.25 1.75 2.5 3.5 5, where `>=` is
    used when the upper neighbour has an even index (0.75, 1.75, 3.5) and `>` otherwise. Zero is
    always encoded as +0.
    """
    a = x.abs()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = ((x < 0) & (idx > 0)).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (any shape) -> fp32 values."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                       device=codes.device)
    return lut[codes.int()]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes -> (N, K/2) uint8, element 2j in the low nibble, 2j+1 in the high nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def global_scale_from_amax(amax: float) -> torch.Tensor:
    """The per-tensor fp32 divisor 448*6/amax (1.0 for an all-zero tensor, whose blocks all get
    scale 0)."""
    amax = torch.tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, FP8_MAX * FP4_MAX / amax, torch.ones_like(amax)).reshape(1)


def quantize_rows(w: torch.Tensor, global_scale: torch.Tensor, with_error: bool = False):
    """Rows of a weight (R, K), any float dtype, K % 16 == 0 -> (packed (R, K/2) uint8,
    scale (R, K/16) fp8).

    With `with_error`, also returns (sum of squared errors, sum of squares) of W_hat against W, in
    fp32. Works in place on one fp32 copy of the rows, so a call needs about 2.5x the fp32 size of
    `w` in temporaries.
    """
    R, K = w.shape
    gs = global_scale.to(device=w.device, dtype=torch.float32)
    blocks = w.to(torch.float32, copy=True).reshape(R, K // BLOCK, BLOCK)         # (R, K/16, 16)
    amax_blk = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1)       # (R, K/16)
    scale = (gs * amax_blk / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)  # (R, K/16)
    eff = scale.float() / gs                                              # (R, K/16) dequant step
    ref2 = blocks.pow(2).sum().item() if with_error else 0.0
    # 0 where eff == 0
    q = blocks.div_(torch.where(eff > 0, eff, torch.full_like(eff, float("inf")))[..., None])
    codes = round_e2m1(q.clamp(-FP4_MAX, FP4_MAX)).reshape(R, K)
    if not with_error:
        return pack_codes(codes), scale
    # error in the quantized domain: (q - q_hat) * eff == W - W_hat
    # (blocks with a zero scale: W itself)
    err = q.sub_(e2m1_values(codes).reshape(R, K // BLOCK, BLOCK)).mul_(eff[..., None])
    err = torch.where(eff[..., None] > 0, err, w.float().reshape(R, K // BLOCK, BLOCK))
    return pack_codes(codes), scale, err.pow(2).sum().item(), ref2


def quantize_weight(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """One weight (N, K) -> (weight_packed (N, K/2) uint8, weight_scale (N, K/16) fp8,
    weight_global_scale (1,) fp32).

    Pass `global_scale` to share one across fused layers (q/k/v, gate/up); by default it comes
    from W's amax.
    """
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise QuantizeError(f"NVFP4 needs a 2-D weight whose K is a multiple of {BLOCK}, "
                            f"got shape {tuple(w.shape)}")
    if global_scale is None:
        global_scale = global_scale_from_amax(w.float().abs().max().item())
    packed, scale = quantize_rows(w, global_scale)
    return packed, scale, global_scale.float().reshape(1).cpu()


def dequantize_weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K/2) uint8, (N, K/16) fp8, (1,) fp32 -> W_hat (N, K): q * (s / global_scale) in fp32,
    cast to dtype.

    Same operation order as the compressed-tensors decompressor, so the bf16 result matches it bit
    for bit.
    """
    q = e2m1_values(unpack_codes(packed))                                       # (N, K)
    step = scale.float() / global_scale.float().to(scale.device)                # (N, K/16)
    return (q * step.repeat_interleave(BLOCK, dim=1)).to(dtype)


def linear_kind(name: str) -> str | None:
    """'model.layers.3.mlp.up_proj.weight' -> 'up_proj'; None for tensors that are not decoder
    Linear weights."""
    parts = name.split(".")
    if (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES
            and ".layers." in name):
        return parts[-2]
    return None


def fused_group(name: str) -> str:
    """The key of the global-scale group a linear weight belongs to (q/k/v together, gate/up
    together)."""
    kind = linear_kind(name)
    prefix = name[: -len(f"{kind}.weight")]
    return prefix + FUSED.get(kind, kind)


def quantize_state_dict(sd: dict, device: str = "cpu") -> tuple[dict, list[str]]:
    """In-memory variant for quantize-on-load: a bf16 state dict -> (NVFP4 state dict, extra
    `ignore` entries).

    Gives exactly the tensors the CLI writes for the same weights.
    """
    amax, out, ignore = {}, {}, []
    for name, t in sd.items():
        if linear_kind(name) and t.shape[-1] % BLOCK == 0:
            g = fused_group(name)
            amax[g] = max(amax.get(g, 0.0), t.float().abs().max().item())
    for name, t in sd.items():
        if linear_kind(name) and t.shape[-1] % BLOCK == 0:
            p = name[: -len(".weight")]
            gs = global_scale_from_amax(amax[fused_group(name)])
            packed, scale = quantize_rows(t.to(device), gs)
            out[p + ".weight_packed"], out[p + ".weight_scale"] = packed.cpu(), scale.cpu()
            out[p + ".weight_global_scale"] = gs
        else:
            if linear_kind(name):
                ignore.append(name[: -len(".weight")])
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    return out, ignore


# --------------------------------------------------------------------------------------------------
# The CLI: scan (validate + amax), plan shards, write, summarise.

def resolve_model_dir(model: str) -> Path:
    p = Path(model)
    if p.is_dir():
        return p
    if p.exists() or model.startswith((".", "/")) or model.count("/") != 1:
        raise QuantizeError(f"--model {model}: no such folder (pass a local HF folder or a hub id "
                            "like Qwen/Qwen2.5-7B-Instruct)")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]))
    except Exception as e:  # network, auth or unknown repo
        raise QuantizeError(f"--model {model}: not a local folder and the hub download failed "
                            f"({type(e).__name__}: {e})")


def check_out(out) -> None:
    """An --out that cannot be written is a QuantizeError before any work (util/fsutil)."""
    try:
        fsutil.check_writable(out, inside=False)
    except ValueError as e:
        raise QuantizeError(str(e)) from None


def list_tensors(model_dir: Path, quantized: bool = False) -> dict[str, tuple[Path, dict, int]]:
    """name -> (file, meta, data start) over all shards. Raises on missing or corrupt input, and on
    already-quantized input unless `quantized` (model.py reading our NVFP4 folders)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted({model_dir / f
                        for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise QuantizeError(f"{model_dir} has no *.safetensors files: "
                            "nanoqerl reads safetensors checkpoints only")
    tensors = {}
    for f in files:
        if not f.exists():
            raise QuantizeError(f"{f.name} is listed in model.safetensors.index.json "
                                f"but missing from {model_dir}")
        try:
            header, start = tensorfile.read_header(f)
        except tensorfile.TensorFileError as e:
            raise QuantizeError(str(e)) from None
        for name, meta in header.items():
            packed = name.endswith(("weight_packed", "weight_scale", "weight_global_scale",
                                    ".qweight"))
            if packed and not quantized:
                raise QuantizeError(f"{model_dir} is already quantized (found {name}): "
                                    "pass the original bf16 checkpoint")
            tensors[name] = (f, meta, start)
    return tensors


def plan_outputs(tensors: dict) -> tuple[list, list[str]]:
    """-> ([(out_name, dtype, shape, src_name, role)], ignore list).
    role: packed / scale / gscale / copy."""
    outs, ignore = [], ["lm_head"]
    for name, (_, meta, _) in tensors.items():
        shape, dt = meta["shape"], tensorfile.DTYPES[meta["dtype"]]
        kind = linear_kind(name)
        if kind and len(shape) == 2 and shape[1] % BLOCK == 0:
            p = name[: -len(".weight")]
            outs += [(p + ".weight_packed", torch.uint8, [shape[0], shape[1] // 2], name, "packed"),
                     (p + ".weight_scale", torch.float8_e4m3fn, [shape[0], shape[1] // BLOCK],
                      name, "scale"),
                     (p + ".weight_global_scale", torch.float32, [1], name, "gscale")]
        else:
            if kind:
                ignore.append(name[: -len(".weight")])
            outs.append((name, torch.bfloat16 if dt.is_floating_point else dt, shape, name, "copy"))
    return outs, ignore


def scan(tensors: dict, device: str, chunk_mb: float, bar) -> dict[str, float]:
    """Check every tensor is finite and return the amax of each global-scale group."""
    amax = {}
    for name, src in tensors.items():
        if not tensorfile.DTYPES[src[1]["dtype"]].is_floating_point:
            continue
        for _, rows in tensorfile.iter_chunks(src, chunk_mb, device):
            rows = rows.float()
            if not torch.isfinite(rows).all():
                raise QuantizeError(f"tensor {name} contains NaN or Inf: "
                                    "the checkpoint is broken, fix it before quantizing")
            if linear_kind(name) and src[1]["shape"][-1] % BLOCK == 0:
                g = fused_group(name)
                amax[g] = max(amax.get(g, 0.0), rows.abs().max().item())
            bar.update(rows.numel())
    return amax


def write_checkpoint(tensors, outs, amax, tmp: Path, device, chunk_mb, shard_mb,
                     bar) -> tuple[dict, dict]:
    """Write shards + index into tmp. Returns (weight_map, per-layer-type relative errors)."""
    shards, cur, size = [], [], 0
    for o in outs:
        nbytes = math.prod(o[2]) * torch.tensor([], dtype=o[1]).element_size()
        if cur and size + nbytes > shard_mb * 2**20:
            shards.append(cur)
            cur, size = [], 0
        cur.append(o)
        size += nbytes
    shards.append(cur)
    weight_map, errors = {}, {}
    for i, shard in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        w = tensorfile.ShardWriter(tmp / fname, [(o[0], o[1], o[2]) for o in shard])
        by_src = {}
        for o in shard:
            by_src.setdefault(o[3], []).append(o)
            weight_map[o[0]] = fname
        for src_name, group in by_src.items():
            roles = {o[4]: o[0] for o in group}
            if "copy" in roles:
                for r0, rows in tensorfile.iter_chunks(tensors[src_name], chunk_mb, device):
                    rows = rows.to(torch.bfloat16) if rows.is_floating_point() else rows
                    w.write_rows(roles["copy"], r0, rows.cpu())
                    bar.update(rows.numel())
                continue
            gs = global_scale_from_amax(amax[fused_group(src_name)])
            if "gscale" in roles:
                w.write_rows(roles["gscale"], 0, gs)
            err2 = ref2 = 0.0
            for r0, rows in tensorfile.iter_chunks(tensors[src_name], chunk_mb, device):
                packed, scale, e2, r2 = quantize_rows(rows, gs, with_error=True)
                if "packed" in roles:
                    w.write_rows(roles["packed"], r0, packed.cpu())
                    err2, ref2 = err2 + e2, ref2 + r2
                    bar.update(rows.numel())
                if "scale" in roles:
                    w.write_rows(roles["scale"], r0, scale.cpu())
            if "packed" in roles:
                errors.setdefault(linear_kind(src_name), []).append(
                    math.sqrt(err2 / max(ref2, 1e-30)))
        w.close()
    if len(shards) > 1:
        total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2))
    return weight_map, errors


def quantize_checkpoint(model: str, out: str | None = None, device: str = "cpu",
                        overwrite: bool = False, chunk_mb: float = 64.0, shard_mb: float = 4096.0,
                        progress: bool = True) -> dict:
    """Quantize a checkpoint folder or hub id into `out` (atomically). Returns the summary dict."""
    from tqdm import tqdm

    # the sizes and a given --out are checked before a hub download, the default --out after it
    for flag, mb in (("--chunk-mb", chunk_mb), ("--shard-mb", shard_mb)):
        if not (math.isfinite(mb) and mb > 0):        # NaN fails every comparison: refused too
            raise QuantizeError(f"{flag} must be a size in MB > 0, got {mb}")
    if out:
        # the output is renamed into place beside it
        check_out(out)
    model_dir = resolve_model_dir(model)
    out = Path(out) if out else Path(model_dir.name.rstrip("/") + "-NVFP4")
    real_in, real_out = model_dir.resolve(), out.resolve()  # symlinks and ./.. spellings resolved
    if real_out == real_in:  # with --overwrite the swap would delete the checkpoint being quantized
        raise QuantizeError(f"--out {out} is the --model folder {model_dir}: that would replace "
                            "the original checkpoint; choose another --out "
                            f"(the default is ./{model_dir.name}-NVFP4)")
    if real_in in real_out.parents:
        raise QuantizeError(f"--out {out} is inside the --model folder {model_dir}: "
                            "choose an --out outside it")
    if real_out in real_in.parents:
        raise QuantizeError(f"--model {model_dir} is inside --out {out}: "
                            "replacing --out would delete it; choose another --out")
    if out.exists() and not overwrite:
        raise QuantizeError(f"--out {out} already exists: pass --overwrite to replace it, "
                            "or choose another --out")
    check_out(out)
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise QuantizeError(f"{model_dir} has no config.json: "
                            "pass a Hugging Face checkpoint folder")
    config = json.loads(cfg_path.read_text())
    if "quantization_config" in config:
        raise QuantizeError(f"{model_dir} is already quantized "
                            f"({config['quantization_config'].get('quant_method')}): "
                            "pass the original bf16 checkpoint")
    archs = config.get("architectures") or ["<none>"]
    if archs[0] not in SUPPORTED_ARCHS:
        raise QuantizeError(f"architecture {archs[0]} is not supported; "
                            f"supported: {', '.join(SUPPORTED_ARCHS)}")
    tensors = list_tensors(model_dir)
    outs, ignore = plan_outputs(tensors)
    t0 = time.time()
    elems = sum(math.prod(m["shape"] or [1]) for _, m, _ in tensors.values())
    # beside --out; on any error (Ctrl-C too) removed
    with fsutil.atomic_dir(out, replace=overwrite) as tmp:
        with tqdm(total=elems, desc="scan", unit="w", unit_scale=True, disable=not progress) as bar:
            amax = scan(tensors, device, chunk_mb, bar)
        with tqdm(total=elems, desc="quantize", unit="w", unit_scale=True,
                  disable=not progress) as bar:
            _, errors = write_checkpoint(tensors, outs, amax, tmp, device, chunk_mb, shard_mb, bar)
        qcfg = json.loads(json.dumps(QUANTIZATION_CONFIG))
        qcfg["ignore"] = ignore
        config["quantization_config"] = qcfg
        config["dtype" if "dtype" in config else "torch_dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in model_dir.iterdir():  # tokenizer, generation config, chat template, licenses...
            if (f.is_file() and f.suffix != ".safetensors"
                    and f.name not in ("config.json", "model.safetensors.index.json")):
                shutil.copy2(f, tmp / f.name)
    bytes_in = sum(math.prod(m["shape"] or [1])
                   * torch.tensor([], dtype=tensorfile.DTYPES[m["dtype"]]).element_size()
                   for _, m, _ in tensors.values())
    bytes_out = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"out": str(out), "quantized": sum(len(v) for v in errors.values()), "ignored": ignore,
            "bytes_in": bytes_in, "bytes_out": bytes_out, "seconds": time.time() - t0,
            "rel_error": {k: {"mean": sum(v) / len(v), "worst": max(v)} for k, v in errors.items()}}


def print_summary(s: dict):
    print(f"wrote {s['out']}: {s['quantized']} linears quantized in {s['seconds']:.1f}s, "
          f"{s['bytes_in'] / 1e9:.3f} GB -> {s['bytes_out'] / 1e9:.3f} GB "
          f"({s['bytes_in'] / max(1, s['bytes_out']):.2f}x)")
    print("relative Frobenius error ||W - W_hat|| / ||W|| per layer type:")
    for k in LINEAR_NAMES:
        if k in s["rel_error"]:
            print(f"  {k:10s} mean {s['rel_error'][k]['mean']:.4f}  "
                  f"worst {s['rel_error'][k]['worst']:.4f}")
    extra = [n for n in s["ignored"] if n != "lm_head"]
    if extra:
        print(f"kept in bf16 (K not a multiple of {BLOCK}), listed in ignore: {', '.join(extra)}")


def release_freed_buffers_promptly():
    """glibc raises its mmap threshold after large frees and then keeps freed chunk buffers in the
    heap; pinning the threshold at 1 MB returns them to the OS at once, so peak memory stays at a
    few chunk buffers."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Quantize a Hugging Face checkpoint to NVFP4 (compressed-tensors layout).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="local HF folder or hub id (e.g. Qwen/Qwen2.5-7B-Instruct)")
    ap.add_argument("--out", default=None, help="output folder; None: ./<model name>-NVFP4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the math runs: cuda (the default where a GPU is present) or cpu")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it already exists")
    ap.add_argument("--chunk-mb", type=float, default=64.0,
                    help="rows processed at a time, in MB of fp32 (bounds memory)")
    ap.add_argument("--shard-mb", type=float, default=4096.0,
                    help="maximum output shard size in MB")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is visible: use --device cpu", file=sys.stderr)
        return 2
    release_freed_buffers_promptly()
    try:
        summary = quantize_checkpoint(args.model, args.out, args.device, args.overwrite,
                                      args.chunk_mb, args.shard_mb, progress=not args.quiet)
    except QuantizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written to --out", file=sys.stderr)
        return 130
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
