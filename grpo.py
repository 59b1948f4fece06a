"""grpo.py: the RL objective of nanoqerl: GRPO, DAPO and Dr.GRPO as pure tensor functions.

    python train.py --algo dapo     # train.py and ppo.py call these; --algo picks a preset
    pytest tests/test_grpo.py       # each formula against numbers worked out by hand

What is here (each formula's source is named where it is defined: the GRPO, DAPO and Dr.GRPO
papers, verl, TRL):
  - group-relative advantages, with (GRPO, DAPO) or without (Dr.GRPO) the std normalisation;
  - DAPO dynamic sampling (drop all-equal groups) and the bookkeeping to refill the batch;
  - DAPO overlong reward shaping and the optional masking of truncated samples;
  - the PPO-clipped policy loss with clip-higher, three loss aggregations, an optional k3 KL to the
    reference policy and a truncated importance-sampling (TIS) weight for rollout/trainer mismatch;
  - the presets that `train.py --algo grpo|dapo|dr_grpo` starts from.

What is not here: models, logits, entropy, sampling, rewards and the training loop itself. Every
function takes tensors (or plain numbers) and returns tensors, so each can be checked by hand on a
few tokens.

Shapes: B prompts (groups), G samples per prompt, S = B*G sequences (group-major: sequence b*G + g
is sample g of prompt b, so `advantages.reshape(-1)` lines up), T completion tokens per sequence
(padded). All log-probabilities are per completion token, of the token that was sampled.
"""
import torch
from torch import Tensor

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

# ----------------------------------------------------------------------------- presets
# Each field is a flag of train.py; a preset only chooses its default.
_COMMON = dict(
    beta=0.0,                 # weight of the k3 KL to the reference (base with LoRA disabled);
                              # 0 = off
    tis_cap=None,             # TIS cap C on pi_trainer / pi_engine; None = TIS_CAP (on for every
                              # engine), 0 = off
    max_sample_rounds=1,      # rollout rounds per step when dynamic sampling refills the batch
    overlong_cache_frac=0.0,  # overlong shaping window as a fraction of the max length; 0 = off
    overlong_factor=1.0,      # overlong penalty reached at the max length
    mask_truncated=False,     # zero the loss mask of samples cut at the max length (finish
                              # reason "length")
)
PRESETS: dict[str, dict] = {
    # GRPO (DeepSeekMath): std-normalised group advantages, symmetric clip, per-sequence token
    # means.
    "grpo": dict(_COMMON,
        std_normalize=True,          # advantage = (r - mean) / (std + eps)
        eps_low=0.2,                 # ratio clipped below at 1 - eps_low (for A < 0)
        eps_high=0.2,                # ratio clipped above at 1 + eps_high (for A > 0)
        agg="seq_mean_token_mean",   # mean over sequences of each sequence's token mean
        dynamic_sampling=False,      # keep all-equal groups (they get zero advantage)
    ),
    # DAPO: clip-higher, token-level loss, dynamic sampling, soft overlong punishment, no KL.
    "dapo": dict(_COMMON,
        std_normalize=True,          # advantage = (r - mean) / (std + eps)
        eps_low=0.2,                 # lower clip as in PPO
        eps_high=0.28,               # clip-higher: room for low-probability tokens to grow
        agg="token_mean",            # every token of the batch weighs the same
        dynamic_sampling=True,       # drop all-equal groups, sample more prompts to refill
        max_sample_rounds=4,         # at most 3 extra rollout rounds per step
        overlong_cache_frac=0.25,    # linear penalty over the last quarter of the max length
    ),
    # Dr.GRPO ("GRPO done right"): no std division, sequence sums over a constant length.
    "dr_grpo": dict(_COMMON,
        std_normalize=False,         # advantage = r - mean (no per-group difficulty weighting)
        eps_low=0.2,                 # symmetric clip as in GRPO
        eps_high=0.2,
        agg="seq_mean_token_sum_norm",  # sum of token losses / max length, mean over sequences
        dynamic_sampling=False,
    ),
}
# TIS on by default, whatever the engine: the samples come from the engine's policy (AQN noise in
# its norms, other kernels or precision), the loss assumes the trainer's, and the weight corrects
# exactly that gap. Where the two are the same policy the weight is 1 and changes nothing, so one
# default gives every engine the same objective.
TIS_CAP = 2.0  # verl's default C (TRL uses 3)


def apply_preset(algo: str, overrides: dict) -> dict:
    """The preset of `algo` updated with `overrides`; overrides whose value is None are ignored, so
    `apply_preset(args.algo, vars(args))` works with argparse flags that default to None. Keys that
    are not preset fields pass through unchanged."""
    if algo not in PRESETS:
        raise ValueError(f"unknown algo {algo!r}; known: {', '.join(sorted(PRESETS))}")
    cfg = dict(PRESETS[algo], algo=algo)
    # the preset's name comes from `algo`, never from overrides (vars(args) carries it too)
    given = {k: v for k, v in overrides.items() if v is not None and k != "algo"}
    cfg.update(given)
    return cfg


def resolve_tis_cap(tis_cap: float | None) -> float | None:
    """The TIS cap to use: None picks the default (TIS_CAP), 0 (or less) turns TIS off."""
    if tis_cap is None:
        return TIS_CAP
    return tis_cap if tis_cap > 0 else None


# ----------------------------------------------------------------------------- advantages
def group_advantages(rewards: Tensor, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages (GRPO): each sample's reward against the other samples of its
    prompt.

    std_normalize=True (GRPO, DAPO): (r - mean) / (std + eps). std_normalize=False (Dr.GRPO):
    r - mean, since dividing by the std up-weights prompts that are nearly always or nearly never
    solved.
    The std is the POPULATION std (divide by G, `unbiased=False`): it is defined for any G >= 1 and
    makes the advantages of a group have unit mean square. torch.std's default (unbiased, G - 1;
    what TRL and verl use) is larger by the constant factor sqrt(G / (G - 1)) for a fixed G, a scale
    the learning rate absorbs.
    A group whose rewards are all equal gets exactly 0 advantage (set explicitly, not left to
    rounding).
    """
    r = rewards.float()                                       # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)                     # (B, G)
    if std_normalize:
        std = r.std(dim=1, unbiased=False, keepdim=True)      # (B, 1), population std
        adv = adv / (std + eps)                               # (B, G)
    flat = zero_variance_groups(rewards)[:, None]             # (B, 1)
    return torch.where(flat, torch.zeros_like(adv), adv)      # (B, G)


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """(B, G) rewards -> (B,) bool: True where every sample of the prompt got the same reward (log
    the mean of it every step: such groups carry no learning signal)."""
    # max == min compares exactly, where std == 0 could miss a group by rounding
    return rewards.amax(dim=1) == rewards.amin(dim=1)        # (B,)


def dynamic_sampling_keep(rewards: Tensor) -> Tensor:
    """DAPO dynamic sampling: (B, G) rewards -> (B,) bool, the groups to keep (those with mixed
    rewards)."""
    return ~zero_variance_groups(rewards)                     # (B,)


def fill_batch(kept_groups: list, needed: int, rounds_done: int,
               max_rounds: int) -> tuple[bool, list, str]:
    """Bookkeeping of DAPO's "sample more prompts until the batch is full", bounded.

    kept_groups: the groups kept so far this step (any objects); needed: groups per training batch;
    rounds_done: rollout rounds done this step (>= 1); max_rounds: the bound (1 = never resample).
    Returns (done, batch, status): status "full" (batch = the first `needed` groups; the rest are
    dropped), "short" (rounds exhausted: batch = everything kept, maybe fewer than needed, maybe
    empty, in which case the caller skips the step) or "more" (not done: roll out another round of
    prompts).
    """
    if len(kept_groups) >= needed:
        return True, kept_groups[:needed], "full"
    if rounds_done >= max_rounds:
        return True, list(kept_groups), "short"
    return False, [], "more"


# ----------------------------------------------------------------------------- overlong shaping
def overlong_penalty(lengths: Tensor, max_len: int, cache: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, added to the reward of each sample.

    0 for len <= max_len - cache; -(len - (max_len - cache)) / cache * factor in the last `cache`
    tokens before max_len; -factor at and beyond max_len. cache = 0 turns it off (all zeros).
    """
    if cache < 0 or cache > max_len:
        raise ValueError(f"overlong cache must be in [0, max_len={max_len}], got {cache}")
    if cache == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    # tokens into the window [max_len - cache, max_len]; the clamp at cache gives -factor beyond it
    over = (lengths.float() - (max_len - cache)).clamp(min=0, max=cache)  # (S,)
    return -over / cache * factor                                          # (S,)


def mask_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    """DAPO overlong filtering: zero the loss mask (S, T) of samples cut at the max length.
    truncated: (S,) bool, e.g. `torch.tensor([f == "length" for f in finish_reasons])`."""
    keep = (~truncated.bool())[:, None].to(mask.dtype)         # (S, 1): 0 for a truncated sample
    return mask * keep                                         # (S, T)


# ----------------------------------------------------------------------------- policy loss
def _k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator of KL(p || q) from samples of p, with log_ratio = log q - log p:
    e^x - x - 1 >= 0 (Schulman, "Approximating KL divergence": unbiased and never negative)."""
    return torch.exp(log_ratio) - log_ratio - 1


def aggregate(loss_tok: Tensor, mask: Tensor, agg: str, max_len: int | None = None,
              num_tokens: float | None = None, num_seqs: float | None = None) -> Tensor:
    """Reduce per-token losses (S, T) to a scalar.

    token_mean (DAPO): sum over all tokens of the batch / number of tokens, so every token weighs
        the same.
    seq_mean_token_mean (GRPO): mean over sequences of each sequence's token mean, so every sequence
        weighs the same and the tokens of a long one weigh less.
    seq_mean_token_sum_norm (Dr.GRPO): mean over sequences of (sum of token losses / max_len), a
        constant, which removes GRPO's length bias (short wrong answers pushed down harder than long
        ones).
    Sequences with no mask token count in no denominator; an all-masked batch gives 0, never NaN.
    Gradient accumulation: when a global batch is split into micro-batches, pass the GLOBAL counts
    so the summed micro-batch losses equal the full-batch loss: num_tokens = total mask tokens
    (token_mean), num_seqs = total sequences with at least one mask token (the two seq_*
    aggregations).
    """
    valid = mask.bool()                                             # (S, T)
    # where(), not loss * mask: padding may hold NaN or -inf, and NaN * 0 is NaN
    tok_sum = torch.where(valid, loss_tok, 0.0).sum(dim=1)          # (S,)
    tok_cnt = valid.sum(dim=1)                                      # (S,)

    if agg == "token_mean":
        if num_tokens is None:
            den = tok_cnt.sum().clamp(min=1)                        # clamp: all-masked gives 0
        else:
            den = max(float(num_tokens), 1.0)
        return tok_sum.sum() / den

    if agg == "seq_mean_token_mean":
        per_seq = tok_sum / tok_cnt.clamp(min=1)                    # (S,)
    elif agg == "seq_mean_token_sum_norm":
        if max_len is None:
            raise ValueError(
                "agg='seq_mean_token_sum_norm' (Dr.GRPO) needs max_len, the constant divisor")
        per_seq = tok_sum / max_len                                 # (S,)
    else:
        raise ValueError(f"unknown agg {agg!r}; known: {', '.join(AGGREGATIONS)}")
    if num_seqs is None:
        den = (tok_cnt > 0).sum().clamp(min=1)                      # sequences with a mask token
    else:
        den = max(float(num_seqs), 1.0)
    return per_seq.sum() / den


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                eps_low: float = 0.2, eps_high: float = 0.2, agg: str = "seq_mean_token_mean",
                max_len: int | None = None, ref_logp: Tensor | None = None, beta: float = 0.0,
                engine_logp: Tensor | None = None, tis_cap: float | None = None,
                num_tokens: float | None = None,
                num_seqs: float | None = None) -> tuple[Tensor, dict]:
    """PPO-clipped policy-gradient loss (GRPO / DAPO / Dr.GRPO), to minimise.

    logp (S, T): the policy being trained (carries the gradient). old_logp (S, T): the trainer's own
    log-probs of the same tokens when the batch was rolled out (pi_old = pi_trainer, no gradient).
    advantages (S,) (or (S, T)). mask (S, T): 1 on completion tokens that count, 0 on
    prompt/padding. Values under mask 0 are never used, so padding may hold anything (even NaN or
    -inf).

    Per token, with r = exp(logp - old_logp):
        ppo  = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)     PPO clip; eps_high > eps_low
               is DAPO's clip-higher (only A > 0 tokens meet the upper bound, only A < 0 ones the
               lower)
        loss = w * ppo + beta * kl
    TIS (FlashRL truncated importance sampling), on when tis_cap is given: the rollout was sampled
        by the engine (pi_engine = exp(engine_logp)), but the trainer's pi_old = exp(old_logp) is
        what the loss assumes, so w = min(exp(old_logp - engine_logp), tis_cap), detached; it
        weighs the PPO term only.
        Without tis_cap, w = 1 (engine_logp, if given, is only used for the mismatch metrics).
    KL (when beta > 0): k3 estimate of KL(pi || pi_ref), kl = exp(ref - logp) - (ref - logp) - 1,
        with ref_logp from the base model (LoRA disabled); DAPO and Dr.GRPO use beta = 0.
    The per-token losses are reduced by `aggregate` (see there for agg, max_len, num_tokens,
    num_seqs).

    Returns (loss, metrics): metrics are floats, token means over this call's mask:
    clip_frac_low/high (tokens whose gradient the clip removed), ratio_mean, approx_kl_old (k3
    KL(pi_old || pi)), tokens, and when given: kl_ref, mismatch_abs (mean |old_logp -
    engine_logp|), mismatch_kl (k3 KL(engine || trainer)), is_ratio_max (the largest raw
    pi_trainer / pi_engine), tis_weight_mean, tis_weight_max and tis_capped_frac (the weights after
    the cap, and the fraction of tokens the cap truncated). is_ratio_max and tis_weight_max are
    maxima over the call's tokens, not means.
    """
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the base model's log-probs, LoRA disabled)")
    if tis_cap is not None and engine_logp is None:
        raise ValueError("tis_cap needs engine_logp (the sampling engine's log-probs)")

    # inputs: fp32 everywhere; only logp carries a gradient
    valid = mask.bool()                                                   # (S, T)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp = logp.float()
    old = old_logp.float().detach()
    adv = advantages.float().detach()
    adv = adv[:, None] if adv.dim() == 1 else adv                         # (S, 1) or (S, T)

    # PPO clip per token; logp padding is zeroed before exp, so a NaN or -inf there cannot leak
    log_ratio = torch.where(valid, logp - old, zero)                      # (S, T)
    ratio = torch.exp(log_ratio)                                          # (S, T)
    surr = ratio * adv                                                    # (S, T)
    surr_clip = ratio.clamp(1 - eps_low, 1 + eps_high) * adv              # (S, T)
    loss_tok = -torch.minimum(surr, surr_clip)                            # (S, T)

    n = valid.sum().clamp(min=1).float()        # mask tokens; clamp: an all-masked call gives 0

    def tmean(x: Tensor) -> float:  # token mean over the mask, for metrics
        return (torch.where(valid, x.detach().float(), zero).sum() / n).item()

    # a clipped token has zero gradient: below the range with A < 0, above it with A > 0
    metrics = {
        "clip_frac_low": tmean((ratio < 1 - eps_low) & (adv < 0)),
        "clip_frac_high": tmean((ratio > 1 + eps_high) & (adv > 0)),
        "ratio_mean": tmean(ratio),
        "approx_kl_old": tmean(_k3(log_ratio)),           # samples come from pi_old
        "tokens": float(valid.sum().item()),
    }

    # rollout/trainer mismatch: metrics always, the TIS weight only when tis_cap is given
    if engine_logp is not None:
        eng = engine_logp.float().detach()
        eng_diff = torch.where(valid, old - eng, zero)         # (S, T) log pi_trainer / pi_engine
        metrics["mismatch_abs"] = tmean(eng_diff.abs())
        metrics["mismatch_kl"] = tmean(_k3(eng_diff))          # k3 KL(engine || trainer)
        raw = torch.exp(eng_diff)                              # (S, T) pi_trainer / pi_engine
        if valid.any():
            metrics["is_ratio_max"] = torch.where(valid, raw, zero).max().item()
        else:
            metrics["is_ratio_max"] = 1.0                      # no token: the neutral ratio
        if tis_cap is not None:
            w = raw.clamp(max=tis_cap)                         # (S, T), detached
            loss_tok = loss_tok * w                            # weighs the PPO term only
            metrics["tis_weight_mean"] = tmean(w)
            ratio_max = metrics["is_ratio_max"]
            metrics["tis_weight_max"] = ratio_max if ratio_max < tis_cap else tis_cap
            metrics["tis_capped_frac"] = tmean(raw > tis_cap)

    # KL to the reference: logged whenever ref_logp is given, in the loss only when beta > 0
    if ref_logp is not None:
        ref = ref_logp.float().detach()
        kl = _k3(torch.where(valid, ref - logp, zero))         # (S, T) k3 KL(pi || pi_ref)
        metrics["kl_ref"] = tmean(kl)
        if beta > 0:
            loss_tok = loss_tok + beta * kl

    loss = aggregate(loss_tok, mask, agg, max_len, num_tokens, num_seqs)
    metrics["loss"] = loss.item()
    return loss, metrics
