"""pretraining.py: what pretrain.py runs besides its loop: the held-out evaluation through
transformers' generate (the model being trained is a transformers model), and the NVFP4 weights
its quantization-aware training runs through (a straight-through estimator).

    python pretrain.py --preset cpu --out DIR       # evaluates every --eval-every steps, QAT at 75%

Leaves out: our rollout engine (it runs model.py's Model, not the transformers model trained here).
"""
import torch

import quantize
from tasks.tokenizer import chat_text, encode_checked


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], check, max_new_tokens: int, sample: bool,
             seed: int) -> dict:
    """Strict held-out accuracy: greedy or one temperature-1 sample per prompt, judged by
    check(text, gold) -> (correct, formatted), the task family's; format = a closed
    \\boxed{...}."""
    model.eval()
    dev = next(model.parameters()).device
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    correct = formatted = 0
    examples = []
    gen = torch.Generator(device=dev).manual_seed(seed)
    for i in range(0, len(rows), 128):
        chunk = rows[i:i + 128]
        prompts = encode_checked(tok, [chat_text(r["question"]) for r in chunk])
        P = max(map(len, prompts))
        # left-padded
        ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=dev)
        out = generate(model, ids, mask, max_new_tokens, sample, gen, stops)
        for r, seq in zip(chunk, out):
            text = tok.decode(seq, skip_special_tokens=True)
            ok, fmt = check(text, r["answer"])
            correct += ok
            formatted += fmt
            if len(examples) < 2:
                examples.append(text)
    model.train()
    return {"accuracy": correct / len(rows), "format_rate": formatted / len(rows),
            "examples": examples}


def generate(model, ids, mask, max_new: int, sample: bool, gen, stops) -> list[list[int]]:
    """Batched decoding with transformers' KV cache: ids (B, P) left-padded -> completion token
    lists."""
    B = ids.shape[0]
    pos = (mask.cumsum(1) - 1).clamp(min=0)                     # (B, P) positions skip the padding
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    cache = out.past_key_values
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    toks = []
    logits = out.logits[:, -1].float()
    last = pos[:, -1]
    for _ in range(max_new):
        if sample:
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]      # (B,)
        else:
            nxt = logits.argmax(-1)                                                 # (B,)
        nxt = torch.where(done, torch.full_like(nxt, stops[-1]), nxt)
        toks.append(nxt)
        done |= torch.isin(nxt, torch.tensor(stops, device=ids.device))
        if done.all():
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=mask.device)], 1)
        last = last + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                    past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[:, -1].float()
    seqs = torch.stack(toks, 1).tolist() if toks else [[] for _ in range(B)]
    # each sequence up to and including its first stop token
    return [s[:next((j + 1 for j, t in enumerate(s) if t in stops), len(s))] for s in seqs]


def rounded_weights(model, base: str) -> dict:
    """The weights as a client will see them: every tensor rounded to bf16 (what ships), and with
    base "nvfp4" the decoder linears replaced by their NVFP4 values (quantize.py's exact scheme,
    shared q/k/v and gate/up scales)."""
    out = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    if base == "nvfp4":
        lin = {n: t for n, t in out.items() if quantize.linear_kind(n)}
        q, _ = quantize.quantize_state_dict(lin, device=str(next(model.parameters()).device))
        for n in lin:
            p = n[:-len(".weight")]
            w = quantize.dequantize_weight(q[p + ".weight_packed"], q[p + ".weight_scale"],
                                           q[p + ".weight_global_scale"])
            out[n] = w.to(lin[n].device)
    return out


class Swapped:
    """with Swapped(model, weights): the model runs with `weights`; on exit its own (master) weights
    come back. Gradients computed inside stay on the parameters: the straight-through estimator of
    quantization-aware training."""

    def __init__(self, model, weights: dict):
        self.params = dict(model.named_parameters())
        self.weights = weights

    def __enter__(self):
        self.saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.weights[n])

    def __exit__(self, *exc):
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.saved[n])
