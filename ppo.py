"""ppo.py: the update half of an RL step: pack the rolled-out groups into a batch, the trainer's
log-probs of the sampled tokens, and epochs x minibatches clipped policy-gradient steps (AdamW) on
the LoRA weights, under torchrun too.

    python train.py --algo dapo        # train.rl_step calls make_batch, batch_logprobs, ppo_update

The loss itself (clipping, token or sequence aggregation, TIS, k3 KL) is grpo.policy_loss; this
file decides which sequences go into which optimizer step, and with which learning rate (the
schedule of trainer/schedule.py, set before every optimizer step). pi_old comes from a no-grad
pass over the batch before any update (batch_logprobs), or with --old-logp reuse, for the first
minibatch, from its own training forward: no update has happened before it.
Under torchrun (util/dist.py) every rank holds the whole batch (gather_groups: the ranks' groups,
a few MB of token ids and log-probs), the shuffle and the minibatch split run over it as in one
process, and each rank trains an equal share of every minibatch (rows rank, rank + world, ... of
it). Each loss is divided by the minibatch's global token and sequence counts, so the summed
gradient is the one-process gradient, and the ranks' shares differ by one sequence at most: with
each rank training only its own groups, a random minibatch gave one rank 34 and the other 30 of its
64 sequences (2 ranks x 64), and every all-reduce waited for the larger share.

Leaves out: value functions (GRPO needs none), gradient accumulation across steps.
"""
import math

import torch

import grpo
import lora
import model as M
from trainer.schedule import lr_factor, set_lr
from util import dist



def gather_groups(groups: list[dict], slots: list[int], ctx) -> list[dict]:
    """Under torchrun: the whole batch's groups on every rank, in their global order (slots: each
    of this rank's groups' place in the batch). Only what make_batch and the advantages read
    travels: prompt, samples and shaped rewards (pickled)."""
    mine = [(s, dict(prompt=g["prompt"], samples=g["samples"], rewards=g["rewards"]))
            for s, g in zip(slots, groups)]
    every = sorted((x for part in ctx.gather(mine) for x in part), key=lambda x: x[0])
    return [g for _, g in every]


def batch_logprobs(model, b, temperature, micro_batch, noise=None, ctx=dist.SINGLE,
                   shared=False, entropy=True, skip=None) -> tuple[torch.Tensor, float, float]:
    """The policy's log-probs of every sequence of b before any update (no gradient), (S, T), and
    (entropy=True) the entropy of those tokens as (sum, token count) over this rank's rows, else
    (0, 0). shared: every rank holds the whole batch (gather_groups): each computes an equal share
    of the rows (rank, rank + world, ...) and one all-reduce fills in the others'. skip: global
    rows left out (zeros; --old-logp reuse, whose first minibatch gets pi_old from its own
    training forward), or None."""
    S = b["ids"].shape[0]
    idx = torch.arange(S, device=b["ids"].device)                            # (S,)
    if skip is not None:
        keep = torch.ones(S, dtype=torch.bool, device=idx.device)
        keep[skip.to(idx.device)] = False
        idx = idx[keep]                                                      # (S - skipped,)
    if shared:
        idx = idx[ctx.rank::ctx.world]                                       # (~S / world,)
    subset = shared or skip is not None                  # idx is not simply every row, in order
    with torch.no_grad():
        # (an empty idx splits into one empty chunk: every row skipped or on other ranks)
        outs = [policy_logprobs(model, b, c, temperature, entropy=entropy, noise=noise)
                for c in idx.split(micro_batch) if len(c)]
    lp = torch.cat([o[0] for o in outs]) if outs else b["mask"][:0]         # (s, T)
    ent_sum = n_tok = 0.0
    if entropy:
        ent = torch.cat([o[1] for o in outs]) if outs else b["mask"][:0]    # (s, T)
        mask = b["mask"][idx] if subset else b["mask"]                       # (s, T)
        ent_sum, n_tok = (ent * mask).sum().item(), mask.sum().item()
    if subset:
        full = torch.zeros_like(b["mask"], dtype=lp.dtype)                   # (S, T)
        full[idx] = lp
        # each row from the one rank that has it
        lp = ctx.sum_tensor(full) if shared else full
    return lp, ent_sum, n_tok


def optimizer(cfg, params) -> torch.optim.AdamW:
    """AdamW over the LoRA weights. No learning rate here: ppo_update sets each step's (set_lr)."""
    return torch.optim.AdamW(params, lr=0.0, weight_decay=cfg.weight_decay)


def make_batch(groups, adv, device):
    """Pack prompt + completion per sequence (S = groups x G sequences, L = the longest prompt +
    completion, T = the longest completion): ids (S, L), valid (S, L), pos (S, T), mask (S, T),
    engine_logp (S, T), truncated (S,), adv (S,)."""
    seqs = [(g["prompt"], s) for g in groups for s in g["samples"]]
    S = len(seqs)
    L = max(len(p) + len(s.tokens) for p, s in seqs)
    T = max(len(s.tokens) for _, s in seqs)
    ids = torch.zeros(S, L, dtype=torch.long)
    valid = torch.zeros(S, L, dtype=torch.bool)
    pos = torch.zeros(S, T, dtype=torch.long)
    mask = torch.zeros(S, T)
    eng = torch.zeros(S, T)
    trunc = torch.zeros(S, dtype=torch.bool)
    for i, (p, s) in enumerate(seqs):
        n = len(s.tokens)
        ids[i, :len(p) + n] = torch.tensor(p + s.tokens)
        valid[i, :len(p) + n] = True
        # the hidden state at position j predicts token j + 1: completion token t is read at
        # len(p) - 1 + t
        pos[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
        mask[i, :n] = 1.0
        eng[i, :n] = torch.tensor(s.logprobs)                   # the sampling engine's log-probs
        trunc[i] = s.finish_reason == "length"
    b = dict(ids=ids, valid=valid, pos=pos, mask=mask, engine_logp=eng, truncated=trunc,
             adv=adv.reshape(-1).float())
    return {k: v.to(device) for k, v in b.items()}


def policy_logprobs(model, b, idx, temperature, entropy=False, noise=None):
    """The policy's log-probs of the completion tokens of sequences idx: (s, T), zeros off the
    mask; with entropy=True also the per-token entropy (s, T), else None. noise: AQN's, or None
    for the clean policy."""
    h = model.forward_padded(b["ids"][idx], b["valid"][idx], noise=noise)     # (s, L, H)
    m = b["mask"][idx] > 0                                                    # (s, T)
    rows = torch.arange(len(idx), device=h.device)[:, None].expand_as(m)[m]   # (n,)
    hs = h[rows, b["pos"][idx][m]]                                            # (n, H)
    tgt = b["ids"][idx].gather(1, b["pos"][idx] + 1)[m]                       # (n,)
    lp, ent = M.token_logprobs(model, hs, tgt, temperature, entropy=entropy)  # (n,), (n,)
    out = torch.zeros(m.shape, device=h.device, dtype=lp.dtype).masked_scatter(m, lp)
    ents = torch.zeros(m.shape, device=h.device).masked_scatter(m, ent) if entropy else None
    return out, ents


# --------------------------------------------------------------------------------------------------
# The update

def shuffled_minibatches(cfg, S, shuffle_seed: int) -> list[torch.Tensor]:
    """The global sequence indices of the step's optimizer steps, in order: each epoch a new
    shuffle of the S sequences (from shuffle_seed), cut into --minibatches parts."""
    g = torch.Generator().manual_seed(shuffle_seed)
    out = []
    for _ in range(cfg.epochs):
        order = torch.randperm(S, generator=g)                                   # (S,)
        out += list(order.chunk(cfg.minibatches))
    return out


def minibatch_plan(cfg, step, rows, S, dev, shuffle_seed: int, ctx=dist.SINGLE):
    """The step's optimizer steps: [(global optimizer step index, this rank's rows of it)].

    Shuffle (from shuffle_seed) and split run over the S global sequence indices, as in one
    process; rows (s,) holds the global index of each of this rank's sequences, or None when the
    rank holds all S (gather_groups): then it takes an equal share of each minibatch."""
    share = slice(None)                             # the rank's own members of a minibatch
    if rows is None:                                # it holds all S: an equal share of each
        rows, share = torch.arange(S), slice(ctx.rank, None, ctx.world)
    where = torch.full((S,), -1, dtype=torch.long)  # global index -> this rank's row (-1: not ours)
    where[rows] = torch.arange(len(rows))
    per_step = cfg.epochs * cfg.minibatches
    plan = []
    for j, mb in enumerate(shuffled_minibatches(cfg, S, shuffle_seed)):
        ours = where[mb][share]
        plan.append((step * per_step + j, ours[ours >= 0].to(dev)))
    return plan


def ppo_update(cfg, p, step, model, b, opt_, rows, S, shuffle_seed: int, noise=None,
               ctx=dist.SINGLE) -> dict:
    """epochs x minibatches AdamW steps on the LoRA weights. Raises FloatingPointError before any
    optimizer step whose loss or gradient norm is not finite, so no NaN reaches the weights.

    b: this rank's sequences (None: it has none); rows (s,): their indices in the global batch of
    S sequences (all of it in one process), or None when b is the whole batch on every rank
    (gather_groups). Each rank runs its members of every minibatch under the minibatch's GLOBAL
    token and sequence counts, and the ranks' gradients are summed before each optimizer step, so
    every rank makes the one-process update. noise: AQN's in the training forward (--aqn-where
    both), else None. With --old-logp reuse the first minibatch's pi_old is its own training
    forward, detached (batch_logprobs skipped its rows: the policy has not moved yet, so that
    forward IS pi_old); its entropy sums come back as ent_sum and ent_tokens."""
    dev = model.model.norm.weight.device
    plan = minibatch_plan(cfg, step, rows, S, dev, shuffle_seed, ctx)
    total = cfg.steps * cfg.epochs * cfg.minibatches              # optimizer steps in the run
    tis = grpo.resolve_tis_cap(p["tis_cap"])

    # Global (tokens, sequences) of every minibatch, in one all-reduce for the whole step
    local = []
    for _, mb in plan:
        n_tok = b["mask"][mb].sum().item() if len(mb) else 0.0
        n_seq = (b["mask"][mb].sum(1) > 0).sum().item() if len(mb) else 0.0
        local += [n_tok, n_seq]
    counts = ctx.sum(local)

    params = lora.lora_parameters(model)
    stats, gnorms, t_allreduce = [], [], 0.0
    reused = torch.zeros(2, device=dev)                # entropy (sum, tokens) of the reused rows
    model.train()
    for k, (i, mb) in enumerate(plan):
        reuse = k == 0 and cfg.old_logp == "reuse"     # before the first update: on-policy
        set_lr(opt_, cfg.lr * lr_factor(i, total, cfg.warmup_steps, cfg.lr_schedule))
        n_tok, n_seq = counts[2 * k], counts[2 * k + 1]
        if n_tok == 0:                                 # all masked on every rank: adds nothing
            continue

        # This rank's members of the minibatch, in micro-batches; gradients accumulate
        parts, bad = [], 0.0
        for c in (mb.split(cfg.micro_batch) if len(mb) else ()):
            if b["mask"][c].sum() == 0:                # all masked: adds nothing
                continue
            lp, ent = policy_logprobs(model, b, c, cfg.temperature, entropy=reuse,
                                      noise=noise)                              # (s, T)
            if reuse:
                b["old_logp"][c] = lp.detach()         # the ratio is exactly 1 here
                reused += torch.stack([(ent * b["mask"][c]).sum(), b["mask"][c].sum()])
            loss, st = grpo.policy_loss(
                lp, b["old_logp"][c], b["adv"][c], b["mask"][c],
                eps_low=p["eps_low"], eps_high=p["eps_high"], agg=p["agg"],
                max_len=cfg.max_new_tokens, beta=p["beta"],
                ref_logp=b["ref_logp"][c] if p["beta"] > 0 else None,
                engine_logp=b["engine_logp"][c], tis_cap=tis,
                num_tokens=n_tok, num_seqs=n_seq)      # normalised by the global counts
            if not torch.isfinite(loss):
                bad = loss.item()
                break
            loss.backward()
            parts.append(st)

        # The one-process gradient on every rank (a non-finite loss anywhere stops all ranks)
        bad, secs = ctx.sum_grads(params, bad)
        t_allreduce += secs
        if not math.isfinite(bad):
            raise FloatingPointError(f"the loss is {bad} at step {step}")
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
        if not math.isfinite(gnorm):
            raise FloatingPointError(f"the gradient norm is {gnorm} at step {step}")
        opt_.step()
        opt_.zero_grad(set_to_none=True)
        stats.append(parts)
        gnorms.append(gnorm)
    model.eval()
    if not stats:
        return {}

    # Metrics of the global minibatches, from every rank's micro-batches
    ranks = ctx.gather(stats)
    merged = [merge_stats([st for r in ranks for st in r[j]]) for j in range(len(stats))]
    out = mean_over_minibatches(merged)
    out["grad_norm"] = sum(gnorms) / len(gnorms)
    out["lr"] = opt_.param_groups[0]["lr"]
    if ctx.world > 1:
        out["t_allreduce"] = t_allreduce
    if cfg.old_logp == "reuse":
        out.update(zip(("ent_sum", "ent_tokens"), reused.tolist()))       # one sync a step
    return out


def merge_stats(parts: list[dict]) -> dict:
    """One minibatch's metrics from its micro-batches' (grpo.policy_loss stats, each with "tokens"):
    the loss is their sum (each was normalised by the minibatch's global counts), keys ending in
    _max take the max, and the other means are weighted by their micro-batch's tokens."""
    tokens = sum(s["tokens"] for s in parts)
    out = {"loss": sum(s["loss"] for s in parts)}
    for k in parts[0]:
        if k in ("loss", "tokens"):
            continue
        if k.endswith("_max"):
            out[k] = max(s[k] for s in parts)
        else:
            out[k] = sum(s[k] * s["tokens"] for s in parts) / max(tokens, 1.0)
    return out


def mean_over_minibatches(stats: list[dict]) -> dict:
    """A step's metrics from its minibatches': means, except maxima for keys ending in _max."""
    out = {}
    for k in stats[0]:
        if k.endswith("_max"):
            out[k] = max(s[k] for s in stats)
        else:
            out[k] = sum(s[k] for s in stats) / len(stats)
    return out
