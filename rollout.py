"""rollout.py: generation for training and evaluation. A built-in engine over model.py, or vLLM
(vllm_backend/engine.py) behind the same interface.

    python rollout.py --model runs/tiny-qwen2 --prompt "What is 2+3?" --n 4 --max-new-tokens 32

One interface:
`engine.generate(prompts, n, max_new_tokens, temperature, top_p, top_k, stop_token_ids, seed,
noise)` -> a list of Sample (group-major: the n samples of prompt 0 first), each with the completion
tokens, the engine's log-probability of each sampled token, and the finish reason ("stop" /
"length").

Seeding: sample k of prompt i draws from its own random stream, seeded by `seed + i * n + k`
(vLLM's per-request seeds count the same way), so what a prompt samples never depends on the other
prompts of the call or on how they are batched; train.py's ranks under torchrun rely on it to draw
what one process draws. On a CPU each row has its own torch.Generator (one small draw per row and
token: 3 ms per 64 x 8-token call, against seconds of decoding). On CUDA one Triton launch writes
the (rows, vocab) noise that torch's exponential_ wrote, from Philox-4x32-10 keyed by each row's
seed and counted by (vocab index, token): no generator state, nothing the host waits for,
capturable in a CUDA graph. It keeps one of Philox's four words per element, about four times
exponential_'s integer work: some tens of microseconds per decode step at 64 x 152k by arithmetic
(unmeasured), against milliseconds for a 7B decode step.

Log-probabilities are of the distribution sampled from: softmax(logits / temperature), restricted
and renormalised to the top-k / top-p set when those are on (the RL default is top_p = 1,
top_k = 0, where this is exactly what the trainer computes). With temperature 0 (greedy) they are
log softmax(logits).

The built-in engine runs the SAME modules the trainer trains: one copy of the NVFP4 base, LoRA
read in place (no sync after an optimizer step) and the step's AQN noise passed to generate and on
to every forward (noise.py: its path). Prompts are
left-padded into one prefill; decode steps write a preallocated KV cache (max_batch x max_len) and
attend over its used part, rounded up to KV_BLOCK slots. On CUDA each decode step is a CUDA graph
per (batch bucket 1, 2, 4, ..., KV bucket); when finished sequences leave half of a bucket idle,
the live ones are compacted into the next smaller bucket, so finished rows stop costing work
(measured by `python -m bench rollout`).

Leaves out: continuous batching across generate calls, paged attention, speculative decoding,
beam search.
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import argparse
import json
import sys
from dataclasses import dataclass

import torch

import lora
import model as M
from kernels import triton
from layers import sampler

if triton is not None:
    import triton.language as tl


@dataclass
class Sample:
    prompt_idx: int          # index into the prompts list
    tokens: list             # completion token ids (with the stop token when one ended it)
    logprobs: list           # the engine's log-prob of each sampled token (module docstring)
    finish_reason: str       # "stop" or "length"


def check_request(prompts, n, max_new_tokens, stop_token_ids, vocab_size: int, max_len: int):
    """Clear errors for bad requests (shared by both engines)."""
    if not prompts or not all(isinstance(p, (list, tuple)) for p in prompts):
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if len(p) + max_new_tokens > max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens="
                             f"{max_new_tokens} that exceeds the context of {max_len}: "
                             "shorten it or lower max_new_tokens")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has a token id outside the vocabulary [0, {vocab_size})")
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    bad = [t for t in (stop_token_ids or []) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"unknown stop token ids {bad}: the vocabulary has {vocab_size} entries")


# ----------------------------------------------------------------------------------------- sampling

def sample_tokens(logits, temperature: float, top_p: float, top_k: int, gen: torch.Generator,
                  race: bool | None = None):
    """logits (B, V) fp32 -> (tokens (B,), logprobs (B,)) under the distribution actually sampled
    from.

    Two exact ways to draw from p: the exponential race (argmax p_i / e_i, e_i ~ Exp(1): one read of
    B x V in chunks, sampler.race_sample; the default on CUDA) and the inverse CDF (one uniform per
    row and a cumsum over V: cheaper on a CPU, the default there). `race` picks one explicitly (the
    tests check both)."""
    if temperature <= 0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]

    # z / t is sampled from; with top-k / top-p the temperature is applied first, so that the
    # cut is made on the tempered distribution
    z, t = logits, temperature                                                 # (B, V)
    if top_k > 0 or top_p < 1.0:
        z, t = logits / temperature, 1.0
    if top_k > 0:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[:, -1:]    # (B, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sz, idx = torch.sort(z, dim=-1, descending=True)                       # (B, V)
        cum = torch.softmax(sz, -1).cumsum(-1)
        drop = cum - torch.softmax(sz, -1) >= top_p          # keep the smallest set reaching top_p
        z = z.scatter(-1, idx, sz.masked_fill(drop, float("-inf")))

    race = logits.is_cuda if race is None else race
    if race:  # one read of z and the noise (sampler.race_sample)
        if isinstance(gen, RowStreams):
            e = gen.draw(z.shape[1], True)                                      # (B, V) Exp(1)
        else:
            e = torch.empty_like(z).exponential_(generator=gen)                 # (B, V) Exp(1)
        return sampler.race_sample(z, e, t)

    # inverse CDF: the first index whose cumulative probability reaches u * total
    logp = torch.log_softmax(z / t, -1)                                        # (B, V)
    cdf = logp.exp().cumsum(-1)                                                # (B, V)
    if isinstance(gen, RowStreams):
        u = gen.draw(1, False)                                                 # (B, 1)
    else:
        u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device)      # (B, 1)
    u = u * cdf[:, -1:]                                   # the cumsum's total is 1 up to rounding
    tok = torch.searchsorted(cdf, u)[:, 0].clamp(max=cdf.shape[-1] - 1)
    finite = torch.isfinite(logp.gather(-1, tok[:, None])[:, 0])
    tok = torch.where(finite, tok, logp.argmax(-1))   # never a -inf token (the clamp may pick one)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


class RowStreams:
    """One random stream per row (see the module docstring): row r's draws at its t-th token depend
    on seeds[r] and t only. `keep` follows the engine's compaction of live rows; `draw` is called
    once per token for every row."""

    def __init__(self, seeds: list[int], device: torch.device):
        self.t = 0                        # tokens drawn so far: the Philox counter's second word
        self.device = device
        if device.type == "cuda":
            self.keys = torch.tensor(seeds, dtype=torch.int64, device=device)  # (B,) Philox keys
        else:
            self.gens = [torch.Generator().manual_seed(s) for s in seeds]

    def keep(self, rows: torch.Tensor):
        """Keep the streams of `rows` (b,), in that order (the engine's compaction)."""
        if self.device.type == "cuda":
            self.keys = self.keys[rows]
        else:
            self.gens = [self.gens[r] for r in rows.tolist()]

    def draw(self, V: int, exponential: bool) -> torch.Tensor:
        """(B, V) fp32: Exp(1) noise, or uniforms in [0, 1); then the next token."""
        if self.device.type == "cuda":
            out = philox_noise(self.keys, self.t, V, exponential)
        elif exponential:
            out = torch.stack([torch.empty(V).exponential_(generator=g) for g in self.gens])
        else:
            out = torch.stack([torch.rand(V, generator=g) for g in self.gens])
        self.t += 1
        return out


def philox_noise(keys, t: int, V: int, exponential: bool) -> torch.Tensor:
    """(B, V) fp32 from Philox-4x32-10 with key keys[r] and counter (v, t): uniforms in (0, 1) with
    23 random bits ((2m + 1) / 2^24, never 0 or 1), or Exp(1) noise -log(u) (never 0 or inf, so the
    race never divides by 0). A pure function of (keys, t): CUDA (or the Triton interpreter on CPU
    tensors, for the tests)."""
    B = keys.shape[0]
    out = torch.empty(B, V, dtype=torch.float32, device=keys.device)
    BV = min(1024, triton.next_power_of_2(V))                   # vocab block
    BR = max(1, min(1024 // BV, triton.next_power_of_2(B)))     # rows block: ~1024 elements
    grid = (triton.cdiv(B, BR), triton.cdiv(V, BV))
    _philox_kernel[grid](out, keys, t, B, V, EXP=exponential, BR=BR, BV=BV)
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["t"])     # t changes every token: one compile for all of them
    def _philox_kernel(out_ptr, key_ptr, t, B, V,
                       EXP: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr):
        # program (rows block, vocab block): one Philox call per element, key = the row's seed,
        # counter (v, t, 0, 0)
        r = tl.program_id(0) * BR + tl.arange(0, BR)                            # (BR,)
        v = tl.program_id(1) * BV + tl.arange(0, BV)                            # (BV,)
        key = tl.load(key_ptr + r, mask=r < B, other=0)                         # (BR,) int64
        c0 = tl.zeros((BR, BV), tl.uint32) + v[None, :].to(tl.uint32)
        c1 = tl.zeros((BR, BV), tl.uint32) + t.to(tl.uint32)
        keys = key[:, None] + tl.zeros((BR, BV), tl.int64)                     # (BR, BV)
        x, _, _, _ = tl.philox(keys, c0, c1, c1 * 0, c1 * 0)    # the first of four words
        u = ((x >> 9).to(tl.float32) * 2.0 + 1.0) * (1.0 / 16777216.0)        # (2m + 1) / 2^24
        if EXP:
            u = -tl.log(u)
        m = (r[:, None] < B) & (v[None, :] < V)
        tl.store(out_ptr + r[:, None].to(tl.int64) * V + v[None, :], u, mask=m)


# ------------------------------------------------------------------------------ the built-in engine

KV_BLOCK = 128  # decode attention reads the cache in multiples of this many slots (a graph each)


class Engine:
    """The built-in engine. max_batch sequences of at most max_len tokens (prompt + completion) at
    a time."""

    def __init__(self, model: M.Model, max_batch: int = 64, max_len: int = 1024,
                 cuda_graphs: bool = True):
        self.model = model
        self.max_batch = max_batch
        self.max_len = max_len
        self.device = model.model.norm.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        cfg = model.cfg
        self.cache = M.KVCache(cfg, max_batch, max_len, self.device, self.dtype)
        # static AQN buffer (layers, 2 norms, hidden): graphs read it, generate copies into it
        self.noise = torch.zeros(cfg.num_layers, 2, cfg.hidden_size, device=self.device)
        # (batch bucket, KV bucket) -> (graph, static buffers, logits); rebuilt when the LoRA
        # layout changes
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.lora_key = None         # what the captured graphs baked in (_check_graph_inputs)
        self.snap = {}               # module -> its LoRA snapshot (lora.snapshot)
        self.use_graphs = cuda_graphs and self.device.type == "cuda"

    # -- one decode step on rows [0, b) of the cache, eager or replayed from a graph ---------------
    def _buffers(self, b):
        return dict(tok=torch.zeros(b, 1, dtype=torch.long, device=self.device),
                    pos=torch.zeros(b, 1, dtype=torch.long, device=self.device),
                    valid=torch.zeros(b, self.max_len, dtype=torch.bool, device=self.device),
                    slot=torch.zeros(1, dtype=torch.long, device=self.device))

    def _step(self, buf, b, kv):
        """One token per row; attention reads the first kv slots of the cache (all slots in use
        lie below kv)."""
        cache = self.cache.rows(b)
        mask = buf["valid"][:, None, None, :kv]                                 # (b, 1, 1, kv)
        h = self.model(buf["tok"], buf["pos"], mask, cache, buf["slot"], kv,
                       noise=self.noise)                                        # (b, 1, H)
        return self.model.logits(h[:, 0]).float()                               # (b, V)

    def _decode(self, b, tok, pos, valid, slot, used):
        """Logits (b, V) for one new token per row, `used` slots filled after it; on CUDA through
        the graph of the (batch bucket, KV bucket) pair: rows padded up to a power of two, slots
        read rounded up to KV_BLOCK."""
        kv = min(self.max_len, -(-used // KV_BLOCK) * KV_BLOCK)   # ceil(used / KV_BLOCK) blocks
        if not self.use_graphs:
            return self._step(dict(tok=tok, pos=pos, valid=valid, slot=slot), b, kv)

        n = b
        b = self._bucket(n)  # pad the rows up to the bucket; the extra rows write unused cache rows
        tok = self._pad(tok, b)
        pos = self._pad(pos, b)
        valid = self._pad(valid, b)
        if (b, kv) not in self.graphs:
            buf = self._buffers(b)
            # the buffers' slot is 0: the warm-up steps write keys/values there, so keep the real
            # ones
            saved_k = self.cache.k[:, :b, :, :1].clone()
            saved_v = self.cache.v[:, :b, :, :1].clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up (compiles kernels, sizes workspaces)
                for _ in range(2):
                    self._step(buf, b, kv)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):  # one memory pool for all the engine's graphs
                out = self._step(buf, b, kv)
            self.graphs[(b, kv)] = (g, buf, out)
            self.cache.k[:, :b, :, :1].copy_(saved_k)
            self.cache.v[:, :b, :, :1].copy_(saved_v)

        # replay: the graph reads its static buffers, so the inputs are copied into them
        g, buf, out = self.graphs[(b, kv)]
        buf["tok"].copy_(tok)
        buf["pos"].copy_(pos)
        buf["valid"].copy_(valid)
        buf["slot"].copy_(slot)
        g.replay()
        return out[:n]

    def _check_graph_inputs(self):
        """Captured graphs bake in which adapters are on and where their snapshot lives: recapture
        when that changes. The snapshot's values are refreshed in place from the trainer's LoRA
        weights at every generate."""
        self.snap = lora.snapshot(self.model, self.snap)
        adapters_on = tuple((n, lin.lora_A is not None and lin.lora_on)
                            for n, lin in self.model.linears())
        addresses = tuple((id(mod), a.data_ptr(), b.data_ptr())
                          for mod, (a, b) in self.snap.items())
        key = (adapters_on, addresses)
        if key != self.lora_key:
            self.graphs = {}
            self.lora_key = key

    @torch.no_grad()
    def generate(self, prompts, n: int = 1, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, stop_token_ids=None,
                 seed: int | None = None, noise: torch.Tensor | None = None) -> list[Sample]:
        """Completions of every prompt (see the module docstring). noise: AQN's (layers, 2, hidden)
        for every forward of this call (noise.draw), or None for the clean policy."""
        cfg = self.model.cfg
        check_request(prompts, n, max_new_tokens, stop_token_ids, cfg.vocab_size, self.max_len)
        stops = set(stop_token_ids if stop_token_ids is not None else cfg.eos_token_ids)
        seed = seed if seed is not None else torch.randint(0, 2**62, (1,)).item()
        # group-major: row j = i * n + k holds sample k of prompt i
        seqs = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(n)]

        # the model in eval mode, with the call's AQN noise copied into the static buffer the
        # graphs read (zeros: w + 0 is w exactly), and the LoRA snapshot attached; all restored in
        # `finally`
        was_training = self.model.training
        self.model.eval()
        if noise is not None:
            self.noise.copy_(noise)
        else:
            self.noise.zero_()
        self._check_graph_inputs()
        for mod, s in self.snap.items():
            mod.snap = s
        try:
            out = []
            for s in range(0, len(seqs), self.max_batch):
                rows = seqs[s:s + self.max_batch]
                seeds = [seed + j for j in range(s, s + len(rows))]  # row j: seed + i * n + k
                gen = RowStreams(seeds, self.device)
                out += self._generate_batch(rows, max_new_tokens, temperature, top_p, top_k,
                                            stops, gen)
        finally:
            for mod in self.snap:
                mod.snap = None
            self.model.train(was_training)
        return out

    def _generate_batch(self, seqs, max_new, temperature, top_p, top_k, stops, gen):
        dev = self.device
        B = len(seqs)
        P = max(len(p) for _, p in seqs)

        # prefill: prompts left-padded to P tokens, written to cache slots [0, P)
        ids = torch.zeros(B, P, dtype=torch.long, device=dev)
        valid = torch.zeros(B, self.max_len, dtype=torch.bool, device=dev)  # (row, slot): key set
        for r, (_, p) in enumerate(seqs):
            ids[r, P - len(p):] = torch.tensor(p, device=dev)
            valid[r, P - len(p):P] = True
        lengths = valid.sum(-1)                                           # (B,) prompt lengths
        cache = self.cache.rows(B)
        slots = torch.arange(P, device=dev)
        pos = (valid[:, :P].long().cumsum(-1) - 1).clamp(min=0)  # (B, P): 0 at each prompt's start
        mask = M.attention_mask(valid[:, :P], valid[:, :P], slots)
        h = self.model(ids, pos, mask, cache, slots, P, noise=self.noise)       # (B, P, H)
        logits = self.model.logits(h[:, -1]).float()                            # (B, V)

        # decode: token t of every live row is sampled from `logits`, then written to slot P + t
        row_seq = list(range(B))             # cache row -> sequence, None once finished
        toks = [[] for _ in range(B)]
        lps = [[] for _ in range(B)]
        reason = ["length"] * B
        for t in range(max_new):
            b = len(row_seq)
            tok, lp = sample_tokens(logits[:b], temperature, top_p, top_k, gen)
            tok_h = tok.to("cpu", non_blocking=True)                            # pinned, async
            lp_h = lp.to("cpu", non_blocking=True)
            done = torch.cuda.Event() if dev.type == "cuda" else None
            if done is not None:
                done.record()
            # decode step t+1 now, so the GPU runs it while the host reads step t's tokens;
            # a row that just stopped costs one wasted step (its output is dropped)
            if t < max_new - 1:
                valid[:b, P + t] = True
                slot = torch.full((1,), P + t, device=dev)  # a fill kernel: torch.tensor blocks
                logits = self._decode(b, tok[:b, None], (lengths[:b] + t)[:, None], valid[:b],
                                      slot, P + t + 1)
            if done is not None:
                done.synchronize()

            # the host side: append each live row's token, retire rows that hit a stop token
            for j, (tk, l) in enumerate(zip(tok_h.tolist(), lp_h.tolist())):
                sq = row_seq[j]
                if sq is None:
                    continue
                toks[sq].append(tk)
                lps[sq].append(l)
                if tk in stops:
                    reason[sq] = "stop"
                    row_seq[j] = None
            live = [j for j, sq in enumerate(row_seq) if sq is not None]
            if not live or t == max_new - 1:
                break

            # compact: live rows to the front, so the next steps run a smaller batch bucket
            # (eagerly, every finished row is dropped at once)
            if len(live) <= b // 2 or (not self.use_graphs and len(live) < b):
                idx = torch.tensor(live, device=dev)
                self.cache.k[:, :len(live)] = self.cache.k[:, idx]
                self.cache.v[:, :len(live)] = self.cache.v[:, idx]
                valid[:len(live)] = valid[idx].clone()
                lengths = lengths[idx]
                logits = logits[idx]
                row_seq = [row_seq[j] for j in live]
                gen.keep(idx)                                       # each row keeps its own stream
        return [Sample(seqs[r][0], toks[r], lps[r], reason[r]) for r in range(B)]

    def _bucket(self, b: int) -> int:
        """The next power of two >= b, at most max_batch: the graph's batch size."""
        return min(self.max_batch, 1 << (b - 1).bit_length())

    @staticmethod
    def _pad(x, b):
        """x (n, ...) padded to (b, ...) with copies of its last row."""
        return x if x.shape[0] == b else torch.cat([x, x[-1:].expand(b - x.shape[0], *x.shape[1:])])


# ------------------------------------------------------------------------------------- command line

def main(argv=None):
    from tasks import data
    import quantize
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(
        description="Sample completions with the built-in engine (a smoke test).")
    ap.add_argument("--model", required=True, help="HF folder or hub id (bf16 or our NVFP4)")
    ap.add_argument("--prompt", action="append",
                    help="a user message (repeatable); chat template applied")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per sample")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    ap.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = M.Model.from_pretrained(args.model, device=dev)
        tok = AutoTokenizer.from_pretrained(quantize.resolve_model_dir(args.model))
        questions = args.prompt or ["What is 2+3?"]
        prompts = [data.prompt_token_ids(tok, q) for q in questions]
        max_len = max(map(len, prompts)) + args.max_new_tokens
        eng = Engine(model, max_batch=max(1, len(prompts) * args.n), max_len=max_len)
        outs = eng.generate(prompts, args.n, args.max_new_tokens, args.temperature, args.top_p,
                            args.top_k, seed=args.seed)
    except (ValueError, quantize.QuantizeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s in outs:
        mean_lp = sum(s.logprobs) / len(s.logprobs)
        print(f"[prompt {s.prompt_idx}, {s.finish_reason}, mean logprob {mean_lp:.2f}] "
              f"{tok.decode(s.tokens)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
