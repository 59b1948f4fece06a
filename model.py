"""model.py: the policy decoder (Qwen2 / Qwen2.5 / Qwen3 / Llama) over our kernels.

    python model.py --model runs/tiny-qwen2 --prompt "What is 2+3?"   # greedy continuation

One module serves rollout and training: `Model.from_pretrained` loads a bf16 checkpoint, our NVFP4
checkpoint (quantized linears run through kernels.nvfp4_linear), or a bf16 checkpoint quantized at
load time with quantize.py's own math; `forward` runs full sequences (training, scoring; optional
per-layer gradient checkpointing) or writes/reads a KV cache (the rollout engine) through the same
layer code. Norms run through layers/ops.rms_norm with the AQN noise passed to `forward` ((layers,
2, hidden) or None: index 0 feeds q/k/v, 1 feeds gate/up); a decode step (one new token a row) runs
layers/attention.decode_attention, everything else torch SDPA. `token_logprobs` scores given tokens
chunk by chunk, so the (tokens, 152k) fp32 logits never exist at once.

Leaves out: sliding-window attention, MoE, rope types other than default and llama3, tensor
parallelism.
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import argparse
import json
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import quantize
from gemm.layout import pack_nvfp4
from layers import attention
from layers.linear import Linear, fuse, mlp_act, next_a, norm_for, project
from layers.ops import rms_norm, rope, rope_cache, rope_cos_sin, rope_inv_freq
from util import tensorfile

SUPPORTED = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


@dataclass
class Config:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: list = field(default_factory=list)


def config_from_hf(d: dict) -> Config:
    arch = (d.get("architectures") or ["<none>"])[0]
    if arch not in SUPPORTED:
        raise ValueError(f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED)}")
    rope = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling")
    if not scaling and rope.get("rope_type", "default") != "default":
        scaling = rope
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else "default"
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope scaling {kind!r} is not supported (default, llama3)")
    eos = d.get("eos_token_id")
    heads = d["num_attention_heads"]
    return Config(arch=SUPPORTED[arch], vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                  intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
                  num_heads=heads, num_kv_heads=d.get("num_key_value_heads", heads),
                  head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                  rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                  rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
                  rope_scaling=scaling, tie_word_embeddings=d.get("tie_word_embeddings", False),
                  qkv_bias=SUPPORTED[arch] == "qwen2" or bool(d.get("attention_bias", False)),
                  qk_norm=SUPPORTED[arch] == "qwen3",
                  max_position_embeddings=d.get("max_position_embeddings", 4096),
                  eos_token_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [])


class Norm(nn.Module):
    """Holds an RMSNorm weight under HF's name (`...norm.weight`); frozen (set requires_grad to
    train it)."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n), requires_grad=False)


class Layer(nn.Module):
    def __init__(self, cfg: Config, idx: int):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.idx, self.cfg = idx, cfg
        self.input_layernorm, self.post_attention_layernorm = Norm(H), Norm(H)
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        a = self.self_attn
        a.q_proj = Linear(H, cfg.num_heads * D, cfg.qkv_bias)
        a.k_proj = Linear(H, cfg.num_kv_heads * D, cfg.qkv_bias)
        a.v_proj = Linear(H, cfg.num_kv_heads * D, cfg.qkv_bias)
        a.o_proj = Linear(cfg.num_heads * D, H, False)
        if cfg.qk_norm:
            a.q_norm, a.k_norm = Norm(D), Norm(D)
        m = self.mlp
        m.gate_proj = Linear(H, cfg.intermediate_size, False)
        m.up_proj = Linear(H, cfg.intermediate_size, False)
        m.down_proj = Linear(cfg.intermediate_size, H, False)

    def forward(self, h, d, cos, sin, mask, noise, cache, slots, kv_len):
        """The hidden state is h + d (d: the previous layer's MLP output, None at layer 0): the
        residual add is fused into this layer's first norm. Returns the next (h, d)."""
        B, T, _ = h.shape
        cfg, a, m = self.cfg, self.self_attn, self.mlp
        z = noise[self.idx] if noise is not None else (None, None)             # AQN: (2, H)
        # (B, T, H); xa: the q/k/v snapshot's A product where the norm makes it (norm_for)
        if d is None:
            x, _, xa = norm_for(a, h, self.input_layernorm.weight, cfg.rms_norm_eps, z[0], None)
        else:
            x, h, xa = norm_for(a, d, self.input_layernorm.weight, cfg.rms_norm_eps, z[0], h)
        q, k, v = project(a, ("q_proj", "k_proj", "v_proj"), x, xa)
        q = q.view(B, T, cfg.num_heads, cfg.head_dim)
        k = k.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, a.q_norm.weight, cfg.rms_norm_eps)
            k = rms_norm(k, a.k_norm.weight, cfg.rms_norm_eps)
        if mask.dim() == 2:
            # a decode step (valid keys (B, S), one new token a row): RoPE, the cache write of the
            # new key and value and the attention over kv_len slots in one kernel
            # (B, kv_heads, kv_len, D)
            ck, cv = cache.k[self.idx][:, :, :kv_len], cache.v[self.idx][:, :, :kv_len]
            # o_proj's snapshot A, where the attention makes o_proj's A product too (next_a)
            a_o = next_a(a.o_proj, q.reshape(B * T, -1))
            out = attention.decode_attention(q.transpose(1, 2), ck, cv, mask,
                                             cfg.head_dim ** -0.5, a_next=a_o,
                                             new=(k[:, 0], v[:, 0], cos[:, 0, 0], sin[:, 0, 0],
                                                  slots))
            o, xa_o = out if a_o is not None else (out, None)
        else:
            xa_o = None
            if cache is not None:
                # generation: rotate q, k and write k, v to the T slots in one kernel
                ck, cv = cache.k[self.idx], cache.v[self.idx]
                q = rope_cache(q, k, v, cos[:, 0], sin[:, 0], ck, cv, slots)
                # (B, kv_heads, kv_len, D)
                k, v = cache.k[self.idx][:, :, :kv_len], cache.v[self.idx][:, :, :kv_len]
            else:
                # (B, heads, T, D)
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.head_dim ** -0.5,
                                               enable_gqa=True)
        o = a.o_proj(o.transpose(1, 2).reshape(B, T, -1), xa_o)                # (B, T, H)
        x, h, xa = norm_for(m, o, self.post_attention_layernorm.weight, cfg.rms_norm_eps, z[1], h)
        return h, m.down_proj(mlp_act(m, x, cfg.intermediate_size, xa))


class KVCache:
    """Preallocated keys and values: (layers, B, kv_heads, max_len, head_dim) each."""

    def __init__(self, cfg: Config, batch: int, max_len: int, device, dtype=torch.bfloat16):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    def rows(self, b: int) -> "KVCache":
        """A view of rows [0, b): the same memory, for a batch smaller than the cache's."""
        view = KVCache.__new__(KVCache)
        view.k = self.k[:, :b]
        view.v = self.v[:, :b]
        view.max_len = self.max_len
        return view


def attention_mask(valid_q: torch.Tensor, valid_k: torch.Tensor,
                   q_slots: torch.Tensor) -> torch.Tensor:
    """(B, T) valid queries, (B, S) valid keys, (T,) query slots -> (B, 1, T, S) bool: causal, valid
    keys; a padded query row sees its own slot, so no row is empty (an empty row would give NaN that
    spreads through attention)."""
    k_slots = torch.arange(valid_k.shape[1], device=valid_k.device)
    causal = k_slots[None, :] <= q_slots[:, None]                              # (T, S)
    m = causal[None] & valid_k[:, None, :]                                     # (B, T, S)
    m = m | ((k_slots[None, :] == q_slots[:, None])[None] & ~valid_q[:, :, None])
    return m[:, None]


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.embed_tokens.weight.requires_grad_(False)
        self.model.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = Norm(cfg.hidden_size)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.lm_head is not None:
            self.lm_head.weight.requires_grad_(False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.grad_checkpoint = False      # recompute each layer in backward

    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def linears(self):
        """(name, Linear) for every decoder linear, with HF / PEFT module names."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, Linear)]

    def forward(self, ids, positions, mask, cache: KVCache | None = None, slots=None,
                kv_len: int | None = None, noise: torch.Tensor | None = None):
        """ids, positions (B, T); mask (B, 1, T, S) bool or additive -> final hidden states (B, T,
        H), normed.

        With a cache, the T new keys/values go to `slots` (T,) and attention reads slots [0,
        kv_len). noise: AQN's (layers, 2, hidden) fp32 (noise.draw), or None for the clean
        policy."""
        # (B, T, H); hidden = h + d
        h, d = self.model.embed_tokens(ids), None
        cos, sin = rope_cos_sin(self.inv_freq, positions, h.dtype)
        if (mask.dtype == torch.bool and cache is not None and ids.shape[1] == 1
                and attention.usable(h, self.cfg.head_dim)):
            # a decode step: the valid keys (B, S) for attention.decode_attention
            mask = mask[:, 0, 0]
        elif mask.dtype == torch.bool:
            # additive, once: SDPA would convert a bool mask in every layer
            additive = torch.zeros(mask.shape, dtype=h.dtype, device=mask.device)
            mask = additive.masked_fill_(~mask, float("-inf"))
        for layer in self.model.layers:
            args = (cos, sin, mask, noise, cache, slots, kv_len)
            if self.grad_checkpoint and torch.is_grad_enabled() and cache is None:
                # saves one tensor a layer: the layer's input, h + d
                x = h if d is None else h + d
                h, d = checkpoint(layer, x, None, *args, use_reentrant=False)
            else:
                h, d = layer(h, d, *args)
        return rms_norm(d, self.model.norm.weight, self.cfg.rms_norm_eps, residual=h)[0]

    def logits(self, h):
        # (..., H) -> (..., V)
        return F.linear(h, self.lm_weight())

    def forward_padded(self, ids, valid, noise=None):
        """Full sequences without a cache: ids (B, T) with `valid` (B, T) bool (padding anywhere) ->
        (B, T, H); noise as in forward."""
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        slots = torch.arange(ids.shape[1], device=ids.device)
        return self(ids, positions, attention_mask(valid, valid, slots), noise=noise)

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype=torch.bfloat16,
                        quantize_on_load: bool = False) -> "Model":
        """A HF folder or hub id: bf16/fp16/fp32, our NVFP4 (compressed-tensors), or bf16 quantized
        while loading."""
        folder = quantize.resolve_model_dir(str(path))
        raw = json.loads((folder / "config.json").read_text())
        cfg = config_from_hf(raw)
        qc = raw.get("quantization_config")
        method = (qc or {}).get("quant_method"), (qc or {}).get("format")
        if qc and method != ("compressed-tensors", "nvfp4-pack-quantized"):
            raise ValueError(f"{folder}: only nvfp4-pack-quantized compressed-tensors checkpoints "
                             f"are supported, got {method[0]} / {method[1]}")
        with torch.device("meta"):
            model = cls(cfg).to(dtype)
        model.to_empty(device=device)
        model.inv_freq = rope_inv_freq(cfg).to(device)
        tensors = quantize.list_tensors(folder, quantized=qc is not None)

        def get(name, shape, dt):
            if name not in tensors:
                raise ValueError(f"{folder}: missing tensor {name}")
            f, meta, start = tensors[name]
            if list(meta["shape"]) != list(shape):
                raise ValueError(f"{folder}: tensor {name} has shape {meta['shape']}, "
                                 f"expected {list(shape)}")
            t = tensorfile.read_rows(f, meta, start, 0, shape[0] if shape else 1)
            return t.to(device=device, dtype=dt).reshape(shape)

        with torch.no_grad():
            VH = (cfg.vocab_size, cfg.hidden_size)
            model.model.embed_tokens.weight.copy_(get("model.embed_tokens.weight", VH, dtype))
            model.model.norm.weight.copy_(get("model.norm.weight", (cfg.hidden_size,), dtype))
            if model.lm_head is not None:
                model.lm_head.weight.copy_(get("lm_head.weight", VH, dtype))
            norms = ("input_layernorm", "post_attention_layernorm")
            if cfg.qk_norm:
                norms += ("self_attn.q_norm", "self_attn.k_norm")
            for layer in model.model.layers:
                p = f"model.layers.{layer.idx}."
                for n in norms:
                    t = layer.get_parameter(n + ".weight")
                    t.copy_(get(p + n + ".weight", tuple(t.shape), dtype))
                lins = [(n[len(p):], m) for n, m in model.linears() if n.startswith(p)]
                bf16 = {}
                for n, lin in lins:
                    if lin.has_bias:
                        lin.bias = get(p + n + ".bias", (lin.out_features,), dtype)
                    N, K = lin.out_features, lin.in_features
                    if p + n + ".weight_packed" in tensors:
                        lin.words, lin.scales, lin.global_scale, *_ = pack_nvfp4(
                            get(p + n + ".weight_packed", (N, K // 2), torch.uint8),
                            get(p + n + ".weight_scale", (N, K // 16), torch.float8_e4m3fn),
                            get(p + n + ".weight_global_scale", (1,), torch.float32))
                    else:
                        bf16[p + n + ".weight"] = get(p + n + ".weight", (N, K), dtype)
                if quantize_on_load and bf16:
                    # same math (and shared q/k/v, gate/up scales) as quantize.py
                    q, _ = quantize.quantize_state_dict(bf16, device=device)
                    for k in [k for k in bf16 if k[:-len(".weight")] + ".weight_packed" in q]:
                        pre = k[:-len(".weight")]
                        bf16.pop(k)
                        lin = model.get_submodule(pre)
                        lin.words, lin.scales, lin.global_scale, *_ = pack_nvfp4(
                            q[pre + ".weight_packed"].to(device),
                            q[pre + ".weight_scale"].to(device),
                            q[pre + ".weight_global_scale"].to(device))
                for k, w in bf16.items():
                    model.get_submodule(k[:-len(".weight")]).weight = w
                fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
                fuse(layer.mlp, ("gate_proj", "up_proj"))
        return model.eval()


def token_logprobs(model: Model, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk: int = 1024, entropy: bool = False):
    """log p(targets) under softmax(logits / temperature) for hidden states h (N, H), targets (N,).

    Chunks of `chunk` tokens: each chunk's fp32 (chunk, V) logits are recomputed in backward, never
    all kept. Returns (logp (N,), entropy (N,) or None); the entropy carries no gradient.
    """
    W = model.lm_weight()
    if h.shape[0] == 0:  # e.g. a micro-batch whose samples are all masked (--mask-truncated)
        empty = h.new_zeros(0, dtype=torch.float32)
        return empty, (empty if entropy else None)

    def one(hc, tc):
        z = F.linear(hc, W).float() / temperature                           # (n, V)
        return z.gather(-1, tc[:, None])[:, 0] - torch.logsumexp(z, -1)     # (n,)

    lps, ents = [], []
    for i in range(0, h.shape[0], chunk):
        hc, tc = h[i:i + chunk], targets[i:i + chunk]
        if torch.is_grad_enabled():
            lps.append(checkpoint(one, hc, tc, use_reentrant=False))
            if entropy:
                with torch.no_grad():
                    lp = torch.log_softmax(F.linear(hc, W).float() / temperature, -1)
                    ents.append(-(lp.exp() * lp).sum(-1))
        else:  # one pass gives both
            lp = torch.log_softmax(F.linear(hc, W).float() / temperature, -1)  # (n, V)
            lps.append(lp.gather(-1, tc[:, None])[:, 0])
            if entropy:
                ents.append(-(lp.exp() * lp).sum(-1))
    return torch.cat(lps), (torch.cat(ents) if entropy else None)


@torch.no_grad()
def greedy(model: Model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Token-by-token greedy decoding with a KV cache (a smoke test; rollout.py has the real
    engine)."""
    dev = model.model.norm.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    cache = KVCache(model.cfg, 1, len(ids) + max_new_tokens, dev, dtype)
    x = torch.tensor([ids], device=dev)
    out, pos = [], 0
    for _ in range(max_new_tokens):
        T = x.shape[1]
        slots = torch.arange(pos, pos + T, device=dev)
        valid = torch.ones(1, pos + T, dtype=torch.bool, device=dev)
        mask = attention_mask(valid[:, pos:], valid, slots)
        h = model(x, slots[None], mask, cache, slots, pos + T)
        nxt = int(model.logits(h[:, -1]).argmax(-1))
        out.append(nxt)
        if nxt in model.cfg.eos_token_ids:
            break
        pos, x = pos + T, torch.tensor([[nxt]], device=dev)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="nanoqerl model smoke test: greedy continuation of one chat prompt "
                    "(lora.py's command line does the same with an adapter).")
    ap.add_argument("--model", required=True,
                    help="HF folder or hub id (bf16 or our NVFP4); util/tiny.py makes a tiny one")
    ap.add_argument("--prompt", default="What is 2+3?",
                    help="user message, formatted with the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    ap.add_argument("--quantize-on-load", action="store_true",
                    help="quantize a bf16 checkpoint to NVFP4 while loading")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = Model.from_pretrained(args.model, device=dev,
                                      quantize_on_load=args.quantize_on_load)
    except (ValueError, FileNotFoundError, quantize.QuantizeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(continue_chat(model, args.model, args.prompt, args.max_new_tokens))
    return 0


def continue_chat(model: Model, model_dir: str, prompt: str, max_new_tokens: int) -> str:
    """The greedy reply to one user message, decoded (model.py's and lora.py's smoke tests)."""
    from transformers import AutoTokenizer

    from tasks import data

    tok = AutoTokenizer.from_pretrained(quantize.resolve_model_dir(model_dir))
    ids = data.prompt_token_ids(tok, prompt)
    return tok.decode(greedy(model, ids, max_new_tokens))


if __name__ == "__main__":
    sys.exit(main())
