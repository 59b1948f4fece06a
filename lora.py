"""lora.py: LoRA adapters on the frozen base model (bf16 or NVFP4 linears), saved and loaded in the
PEFT format.

    python lora.py --model DIR --adapter ADAPTER_DIR [--merge-to OUT]   # check one; export merged

y = base(x) + (dropout(x) @ A^T) @ B^T * alpha / r on every targeted linear (layers/linear.Linear
holds A (r, in) and B (out, r) as fp32 parameters; layers/linear.py has the product, run in the
activations' dtype). The functions work on any model whose linears() lists them; only the command
line loads a model.py Model. B starts at zero, A like PEFT (Kaiming uniform), so a fresh adapter
changes nothing. Disabling the adapters gives the reference policy for the KL term at no memory
cost. Files: adapter_config.json + adapter_model.safetensors with PEFT's tensor names
(base_model.model.<module>.lora_A.weight), so peft.PeftModel and vLLM's LoRA loader read ours and we
read theirs. A file that cannot be read (cut short, not safetensors, not JSON) is a ValueError that
names it and says what to do, never the reader's own exception.

Leaves out: every PEFT LoRA option beyond plain LoRA (DoRA, rsLoRA, per-module ranks or alphas, some
layers only, bias training, modules_to_save, PiSSA-style inits that edit the base, ...):
load_adapter refuses such adapters by name rather than load them with another meaning (see
PLAIN_FIELDS).
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import argparse
import contextlib
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

import kernels
import quantize
from layers.linear import group_ab
from util import fsutil

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."

# adapter_config.json (PEFT's LoraConfig, peft 0.21): the fields load_adapter reads, and those that
# do not change what a plain adapter computes (metadata, settings of options refused anyway, inputs
# of init methods that only init_lora_weights turns on). Every OTHER field must be unset (null,
# false, empty) or the adapter is refused: an option ignored here would load silently with another
# meaning (an alpha_pattern gives the wrong scale). A field that a later PEFT release adds is
# refused the same way until someone checks what it does.
PLAIN_FIELDS = {"r", "lora_alpha", "lora_dropout", "target_modules", "peft_type", "bias",
                "init_lora_weights", "task_type", "auto_mapping", "peft_version",
                "base_model_name_or_path", "revision", "inference_mode",
                "runtime_config", "megatron_core", "qalora_group_size", "ensure_weight_tying",
                "loftq_config", "eva_config", "corda_config", "lora_ga_config"}
# Initialisations after which A and B alone are the adapter; PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA
# also edit the base weights, and MiCA is a variant with its own forward.
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
WHY = {"alpha_pattern": "per-module alphas", "rank_pattern": "per-module ranks", "use_dora": "DoRA",
       "use_rslora": "rsLoRA, scale alpha/sqrt(r)",
       "layers_to_transform": "adapters on some layers only",
       "layers_pattern": "adapters on some layers only",
       "modules_to_save": "whole modules trained beside the adapter",
       "fan_in_fan_out": "weights stored transposed", "lora_bias": "a bias on lora_B",
       "exclude_modules": "excluded modules",
       "trainable_token_indices": "trained embedding rows",
       "target_parameters": "LoRA on parameters, not modules",
       "layer_replication": "replicated layers", "megatron_config": "Megatron parallel layers",
       "alora_invocation_tokens": "activated LoRA", "use_qalora": "QA-LoRA",
       "bias": "trained biases",
       "init_lora_weights": "an init that edits the base weights, or a LoRA variant",
       "target_modules": "a regular expression; pass a list of module names"}


def add_lora(model, rank: int = 32, alpha: float = 64.0, dropout: float = 0.0,
             targets=DEFAULT_TARGETS, seed: int = 0) -> list[nn.Parameter]:
    """Attach fresh adapters to the linears whose last name is in `targets`. Returns the trainable
    parameters."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    known = {n.split(".")[-1] for n, _ in model.linears()}
    if not set(targets) <= known:
        raise ValueError(f"unknown LoRA target modules {sorted(set(targets) - known)}; "
                         f"this model has {sorted(known)}")
    g = torch.Generator().manual_seed(seed)
    params = []
    for name, lin in model.linears():
        if name.split(".")[-1] not in targets:
            continue
        dev = lin.words.device if lin.words is not None else lin.weight.device
        A = torch.empty(rank, lin.in_features)
        # = kaiming_uniform_(a=sqrt(5)), PEFT's default for lora_A
        bound = 1 / math.sqrt(lin.in_features)
        A.uniform_(-bound, bound, generator=g)
        lin.lora_A = nn.Parameter(A.to(dev))
        lin.lora_B = nn.Parameter(torch.zeros(lin.out_features, rank, device=dev))
        lin.lora_scale, lin.lora_dropout, lin.lora_on = alpha / rank, dropout, True
        params += [lin.lora_A, lin.lora_B]
    model.lora_config = {"r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
                         "target_modules": sorted(targets)}
    return params


def lora_parameters(model) -> list[nn.Parameter]:
    adapted = [lin for _, lin in model.linears() if lin.lora_A is not None]
    return [p for lin in adapted for p in (lin.lora_A, lin.lora_B)]


def set_enabled(model, on: bool):
    for _, lin in model.linears():
        lin.lora_on = on


@contextlib.contextmanager
def disabled(model):
    """The base policy (adapters off), e.g. the reference for the KL term."""
    set_enabled(model, False)
    try:
        yield model
    finally:
        set_enabled(model, True)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """PEFT tensor names -> fp32 tensors (CPU)."""
    out = {}
    for name, lin in model.linears():
        if lin.lora_A is not None:
            out[f"{PREFIX}{name}.lora_A.weight"] = lin.lora_A.detach().float().cpu().contiguous()
            out[f"{PREFIX}{name}.lora_B.weight"] = lin.lora_B.detach().float().cpu().contiguous()
    return out


def save_adapter(model, path, base_model: str = "") -> Path:
    """Write adapter_config.json + adapter_model.safetensors to `path`, atomically (fsutil: a
    temporary folder beside it, renamed into place; an existing adapter there is replaced)."""
    if not getattr(model, "lora_config", None):
        raise ValueError("the model has no LoRA adapters: call add_lora first")
    path = Path(path)
    c = model.lora_config
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM",
           "base_model_name_or_path": str(base_model),
           "r": c["r"], "lora_alpha": c["lora_alpha"], "lora_dropout": c["lora_dropout"],
           "target_modules": c["target_modules"], "bias": "none", "fan_in_fan_out": False,
           "inference_mode": True, "init_lora_weights": True,
           "use_rslora": False, "use_dora": False,
           "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
           "rank_pattern": {}, "alpha_pattern": {}}
    with fsutil.atomic_dir(path, replace=True) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
        save_file(adapter_state(model), tmp / "adapter_model.safetensors",
                  metadata={"format": "pt"})
    return path


def check_plain(cfg: dict, path) -> list[str]:
    """The target module names of a plain LoRA adapter_config.json; ValueError naming the first
    field that asks for more than plain LoRA (see PLAIN_FIELDS), with what to do instead."""
    def unset(v):  # 0 is a value here (layers_to_transform=0 means layer 0), so not `not v`
        return v is None or v is False or (isinstance(v, (str, list, dict)) and not v)

    bad = [k for k, v in cfg.items() if k not in PLAIN_FIELDS and not unset(v)]
    plain = {"peft_type": cfg.get("peft_type", "LORA") == "LORA",
             "bias": cfg.get("bias", "none") == "none",
             "init_lora_weights": cfg.get("init_lora_weights", True) in PLAIN_INITS,
             # PEFT reads a string as a regex
             "target_modules": not isinstance(cfg.get("target_modules"), str)}
    bad += [k for k, ok in plain.items() if not ok]
    if bad:
        k = bad[0]
        raise ValueError(f"{path}: adapter_config.json sets {k}={json.dumps(cfg[k])[:80]} "
                         f"({WHY.get(k, 'not a plain LoRA option')}), which lora.py does not "
                         "implement: it loads plain LoRA only (one r and lora_alpha for all target "
                         "modules, bias 'none'); merge this adapter into its base with peft "
                         "(merge_and_unload) instead")
    if not cfg.get("target_modules") or not cfg.get("r"):
        raise ValueError(f"{path}: adapter_config.json needs r and target_modules "
                         f"(got {cfg.get('r')!r}, {cfg.get('target_modules')!r}); "
                         "is it a LoRA adapter?")
    return list(cfg["target_modules"])


class AdapterFileError(ValueError):
    """An adapter file that cannot be read at all: cut short, or not a safetensors file. `path`
    is the file, `detail` what the reader said (trainer/checkpoint.py words its own advice)."""

    def __init__(self, path: Path, detail: str):
        self.path, self.detail = path, detail
        super().__init__(f"{path} is truncated or not a safetensors file ({detail}): save the "
                         "adapter again (save_adapter, or peft's save_pretrained), or copy the "
                         "whole file again if it came from elsewhere")


def read_adapter_file(f: Path) -> dict[str, torch.Tensor]:
    """The tensors of adapter_model.safetensors; AdapterFileError when it cannot be read."""
    try:
        return load_file(f)
    except SafetensorError as e:     # a copy cut short, an empty file, a Git LFS pointer, ...
        raise AdapterFileError(f, str(e)) from None


def load_adapter(model, path) -> dict:
    """Load a PEFT adapter (ours or peft's) into the model, adding LoRA modules if it has none.
    Returns its config. A file that cannot be read is a ValueError naming it (AdapterFileError
    for adapter_model.safetensors)."""
    path = Path(path)
    if not (path / "adapter_config.json").exists():
        raise FileNotFoundError(f"{path} has no adapter_config.json: pass a folder written by "
                                "save_adapter or peft")
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'adapter_config.json'} is not valid JSON ({e}): write the "
                         "adapter again, or fix the file") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path / 'adapter_config.json'} holds a {type(cfg).__name__}, not a "
                         "JSON object: is it a PEFT adapter_config.json?")
    targets = check_plain(cfg, path)
    alpha, dropout = cfg["lora_alpha"], cfg.get("lora_dropout", 0.0)
    f = path / "adapter_model.safetensors"
    if not f.exists():
        raise FileNotFoundError(f"{path} has no adapter_model.safetensors "
                                "(a .bin adapter must be converted first)")
    sd = {k.replace(".default.", "."): v for k, v in read_adapter_file(f).items()}
    if getattr(model, "lora_config", None) is None:
        add_lora(model, cfg["r"], alpha, dropout, tuple(targets))
    else:
        have = model.lora_config
        if have["r"] != cfg["r"] or sorted(have["target_modules"]) != sorted(targets):
            raise ValueError(f"{path}: adapter has r={cfg['r']}, targets {sorted(targets)}; "
                             f"the model's LoRA has r={have['r']}, "
                             f"targets {have['target_modules']}")
    adapted = [(name, lin) for name, lin in model.linears() if lin.lora_A is not None]
    pairs = [(f"{PREFIX}{name}.{part}.weight", param) for name, lin in adapted
             for part, param in (("lora_A", lin.lora_A), ("lora_B", lin.lora_B))]
    for key, param in pairs:
        # every check before the first copy: a refused adapter leaves the model as it was
        if key not in sd:
            raise ValueError(f"{path}: missing tensor {key}")
        if tuple(sd[key].shape) != tuple(param.shape):
            raise ValueError(f"{path}: tensor {key} has shape {tuple(sd[key].shape)}, "
                             f"the model needs {tuple(param.shape)}")
    extra = sorted(set(sd) - {key for key, _ in pairs})
    if extra:
        raise ValueError(f"{path}: tensors for modules this model does not have, e.g. {extra[0]}")
    with torch.no_grad():
        for key, param in pairs:
            param.copy_(sd[key])  # in place: an optimizer holding these parameters keeps them
    for _, lin in model.linears():
        if lin.lora_A is not None:
            lin.lora_scale, lin.lora_dropout = alpha / cfg["r"], dropout
    # the model's LoRA now IS this adapter, alpha and dropout included, so that save_adapter writes
    # what was loaded
    model.lora_config = {**model.lora_config, "lora_alpha": alpha, "lora_dropout": dropout}
    return cfg


def export_merged(model, src_dir, out_dir) -> Path:
    """Write a bf16 HF folder with W_hat + B @ A * scale merged into every adapted linear (for
    serving elsewhere; `python model.py --model SRC --adapter DIR --merge-to OUT` writes one and
    loads it back)."""
    src, out = quantize.resolve_model_dir(str(src_dir)), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists: choose another folder")
    sd = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            # kernel-layout buffers, the adapters and the fused views are not HF tensors
            packed = name.endswith(("words", "scales", "global_scale", "inv_freq"))
            if packed or ".lora_" in name or ".fused." in name:
                continue
            sd[name] = t.to(torch.bfloat16).cpu()
        for name, lin in model.linears():
            if lin.words is not None:
                w = kernels.dequantize_ref(lin.qweight())
            else:
                w = lin.weight.float()
            if lin.lora_A is not None:
                w = w + (lin.lora_B.float() @ lin.lora_A.float()).to(w.device) * lin.lora_scale
            sd[name + ".weight"] = w.to(torch.bfloat16).cpu().contiguous()
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config", None)
    with fsutil.atomic_dir(out) as tmp:
        # beside `out`, its parent made if needed: the final rename stays on one disk
        tensors = {k: v.contiguous() for k, v in sd.items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        for f in src.iterdir():
            ours = ("config.json", "model.safetensors.index.json")
            skip = f.suffix == ".safetensors" or f.name in ours
            if f.is_file() and not skip:
                shutil.copy2(f, tmp / f.name)
    return out


@torch.no_grad()
def snapshot(model, old: dict | None = None) -> dict:
    """For generation only: per fused group (and per unfused linear) where some member has an active
    adapter, one A (sum of ranks, in) and one block-diagonal B (rows, sum of ranks) with the LoRA
    scale folded in, in the model's dtype: the adapter then costs two GEMMs per group instead of two
    casts, two GEMMs, a scale and an add per member. Returns {module: (A, B)}; refreshed in place
    when `old` has the same shapes (CUDA graphs keep their pointers)."""
    snap = {}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        groups = ((a, ("q_proj", "k_proj", "v_proj")), (a, ("o_proj",)),
                  (m, ("gate_proj", "up_proj")), (m, ("down_proj",)))
        for parent, names in groups:
            lins = [getattr(parent, n) for n in names]
            mod = lins[0] if len(lins) == 1 else getattr(parent, "fused", None)
            if mod is None or not any(lin.lora_A is not None and lin.lora_on for lin in lins):
                continue
            pads = mod.pads if len(lins) > 1 else [lins[0].out_features]
            # (R, in), (rows, R)
            A, B = group_ab(lins, pads, model.model.embed_tokens.weight.dtype)
            prev = (old or {}).get(mod)
            if prev is not None and prev[0].shape == A.shape and prev[1].shape == B.shape:
                prev[0].copy_(A)
                prev[1].copy_(B)
                A, B = prev
            snap[mod] = (A, B)
    return snap


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Check a LoRA adapter on its base: load it (refused by name if it uses a PEFT "
                    "option this file does not implement), print the greedy reply to one prompt, "
                    "and optionally write the merged bf16 model.")
    ap.add_argument("--model", required=True, help="the base: HF folder or hub id (bf16 or NVFP4)")
    ap.add_argument("--adapter", required=True,
                    help="adapter folder (adapter_config.json + adapter_model.safetensors)")
    ap.add_argument("--merge-to", default=None,
                    help="write the base with the adapter merged in here, as a bf16 HF folder "
                         "(and load it back)")
    ap.add_argument("--prompt", default="What is 2+3?",
                    help="user message, formatted with the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    import model as M

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = M.Model.from_pretrained(args.model, device=dev)
        cfg = load_adapter(model, args.adapter)
        n = len(lora_parameters(model)) // 2
        print(f"loaded r={cfg['r']} alpha={cfg['lora_alpha']} on {n} linears")
        if args.merge_to:
            out = export_merged(model, args.model, args.merge_to)
            M.Model.from_pretrained(out)                        # the export must load back
            print(f"wrote {out}")
    except (ValueError, FileNotFoundError, FileExistsError, quantize.QuantizeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(M.continue_chat(model, args.model, args.prompt, args.max_new_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
