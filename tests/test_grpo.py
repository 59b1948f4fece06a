"""grpo.py against hand-computed examples: a few tokens, two groups, numbers worked out in the
comments."""
import math

import pytest
import torch

import grpo
from grpo import (PRESETS, aggregate, apply_preset, dynamic_sampling_keep, fill_batch,
                  group_advantages, mask_truncated, overlong_penalty, policy_loss, resolve_tis_cap,
                  zero_variance_groups)

LN = math.log


def close(x, y, tol=1e-5):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32),
                          torch.as_tensor(y, dtype=torch.float32), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- advantages
def test_group_advantages_std_is_population():
    # group 0: [0, 0, 0, 1]: mean 0.25, population var = (3*0.0625 + 0.5625)/4 = 0.1875,
    #   std = 0.4330127
    #   -> -0.25/0.4330127 = -0.5773503, 0.75/0.4330127 = 1.7320508
    #   (the unbiased std would be sqrt(0.75/3) = 0.5 -> -0.5, 1.5: this test tells them apart)
    # group 1: [1, 1, 1, 1]: all equal -> 0
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = group_advantages(r, std_normalize=True, eps=0.0)
    assert close(a, [[-0.5773503, -0.5773503, -0.5773503, 1.7320508], [0, 0, 0, 0]])
    # eps goes into the denominator: [1, 0] -> mean 0.5, std 0.5 -> +-0.5 / (0.5 + 0.5) = +-0.5
    assert close(group_advantages(torch.tensor([[1.0, 0.0]]), eps=0.5), [[0.5, -0.5]])


def test_group_advantages_without_std_dr_grpo():
    # Dr.GRPO: r - mean only. [0, 0, 0, 1] -> mean 0.25 -> [-0.25, -0.25, -0.25, 0.75];
    # [2, 0, 1, 1] -> mean 1
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0], [2.0, 0.0, 1.0, 1.0]])
    assert close(group_advantages(r, std_normalize=False),
                 [[-0.25, -0.25, -0.25, 0.75], [1, -1, 0, 0]])


def test_all_equal_group_is_exactly_zero():
    # 0.1 is not exact in binary; the advantage must still be exactly 0, with and without std
    r = torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3]])
    for std in (True, False):
        assert torch.equal(group_advantages(r, std_normalize=std), torch.zeros(2, 3))


# ----------------------------------------------------------------------------- dynamic sampling
def test_dynamic_sampling_filter():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.4]])
    assert zero_variance_groups(r).tolist() == [True, False, True, False]
    assert dynamic_sampling_keep(r).tolist() == [False, True, False, True]


def test_fill_batch_bookkeeping():
    # enough groups: done, batch trimmed to `needed`, in order
    assert fill_batch(["a", "b", "c", "d", "e"], needed=4, rounds_done=1, max_rounds=3) == \
        (True, ["a", "b", "c", "d"], "full")
    # too few and rounds left: sample more
    assert fill_batch(["a", "b", "c"], needed=4, rounds_done=2, max_rounds=3) == (False, [], "more")
    # too few and the bound is reached: train on what we have (or nothing)
    assert fill_batch(["a", "b"], needed=4, rounds_done=3, max_rounds=3) == \
        (True, ["a", "b"], "short")
    assert fill_batch([], needed=4, rounds_done=1, max_rounds=1) == (True, [], "short")


# ----------------------------------------------------------------------------- overlong shaping
def test_overlong_penalty_boundaries():
    # max_len 10, cache 4: the window is lengths 7..10 (start = 6)
    # 5 -> 0; 6 -> 0 (last free length); 7 -> -1/4; 9 -> -3/4; 10 -> -1; 12 -> -1 (beyond max)
    lengths = torch.tensor([5, 6, 7, 9, 10, 12])
    assert close(overlong_penalty(lengths, max_len=10, cache=4), [0, 0, -0.25, -0.75, -1.0, -1.0])
    assert close(overlong_penalty(lengths, max_len=10, cache=4, factor=0.5),
                 [0, 0, -0.125, -0.375, -0.5, -0.5])
    assert torch.equal(overlong_penalty(lengths, max_len=10, cache=0), torch.zeros(6))
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_len=10, cache=11)


def test_mask_truncated():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    truncated = torch.tensor([f == "length" for f in ["stop", "length", "stop"]])
    assert mask_truncated(mask, truncated).tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]


# ----------------------------------------------------------------------------- clipping
def test_clip_boundaries_both_signs():
    # six one-token sequences, eps_low 0.2 / eps_high 0.28 (clip range [0.8, 1.28]), token_mean,
    # old_logp 0
    #   A   ratio  -min(rA, clip(r)A)                 d loss_t / d logp_t = -r*A if unclipped else 0
    #  +1   1.1    inside                  -> -1.1    -1.1
    #  +1   1.5    above 1.28, clipped     -> -1.28    0
    #  -1   0.5    below 0.8, clipped      -> +0.8     0
    #  -1   1.5    above, A<0: not clipped -> +1.5    +1.5
    #  +1   0.5    below, A>0: not clipped -> -0.5    -0.5
    #  -1   1.2    inside                  -> +1.2    +1.2
    # token mean = (-1.1 - 1.28 + 0.8 + 1.5 - 0.5 + 1.2) / 6 = 0.62 / 6 = 0.1033333; grads / 6
    ratios = torch.tensor([1.1, 1.5, 0.5, 1.5, 0.5, 1.2])
    logp = ratios.log()[:, None].requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0])
    loss, m = policy_loss(logp, torch.zeros(6, 1), adv, torch.ones(6, 1),
                          eps_low=0.2, eps_high=0.28, agg="token_mean")
    assert close(loss, 0.62 / 6)
    # each token alone (a sum can hide a swapped eps_low / eps_high: -1.28+0.8 == -1.2+0.72)
    for i, want in enumerate([-1.1, -1.28, 0.8, 1.5, -0.5, 1.2]):
        one, _ = policy_loss(logp[i:i + 1], torch.zeros(1, 1), adv[i:i + 1], torch.ones(1, 1),
                             eps_low=0.2, eps_high=0.28, agg="token_mean")
        assert close(one, want), (i, one.item(), want)
    loss.backward()
    assert close(logp.grad[:, 0], torch.tensor([-1.1, 0, 0, 1.5, -0.5, 1.2]) / 6)
    assert close(m["clip_frac_high"], 1 / 6) and close(m["clip_frac_low"], 1 / 6)
    assert close(m["ratio_mean"], (1.1 + 1.5 + 0.5 + 1.5 + 0.5 + 1.2) / 6)
    assert m["tokens"] == 6.0


def test_clip_higher_versus_symmetric():
    # A = +1, ratio 1.25: clip-higher (1.28) leaves it alone -> -1.25;
    # symmetric 0.2 clips it -> -1.2
    # A = -2, ratio 0.75: both clip below at 0.8 -> -min(-1.5, -1.6) = +1.6
    logp = torch.tensor([[LN(1.25)], [LN(0.75)]])
    adv, old, mask = torch.tensor([1.0, -2.0]), torch.zeros(2, 1), torch.ones(2, 1)
    hi, m = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, agg="token_mean")
    sym, _ = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, agg="token_mean")
    assert close(hi, (-1.25 + 1.6) / 2) and close(sym, (-1.2 + 1.6) / 2)
    assert m["clip_frac_high"] == 0.0 and m["clip_frac_low"] == 0.5


def test_gradient_sign_increases_logp_of_positive_advantage():
    # on-policy (ratio 1): loss_t = -A * r, d/dlogp = -A: gradient descent moves logp by +lr*A
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach().clone(), torch.tensor([0.5, -2.0]), torch.ones(2, 1),
                          agg="token_mean")
    assert close(loss, (-0.5 + 2.0) / 2)
    loss.backward()
    assert logp.grad[0, 0] < 0 < logp.grad[1, 0]
    assert close(logp.grad[:, 0], [-0.25, 1.0])  # -A / 2 tokens


# ----------------------------------------------------------------------------- aggregations
def _two_seqs():
    # seq 0: 3 tokens with A = +1 -> token losses [-1, -1, -1]; seq 1: 1 token with A = -2 -> [+2]
    # (on-policy, ratio 1). Padding holds -inf / NaN to show it never leaks in.
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, float("-inf"), float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return logp, mask, torch.tensor([1.0, -2.0])


@pytest.mark.parametrize("agg,kw,expected", [
    ("token_mean", {}, (-3 + 2) / 4),                          # -0.25: every token weighs the same
    ("seq_mean_token_mean", {}, (-1 + 2) / 2),                 # 0.5: per-seq means -1 and 2
    # -0.125: sums over constant 4
    ("seq_mean_token_sum_norm", {"max_len": 4}, (-3 / 4 + 2 / 4) / 2),
    ("token_mean", {"num_tokens": 8}, (-3 + 2) / 8),           # global token count of 8
    ("seq_mean_token_mean", {"num_seqs": 4}, (-1 + 2) / 4),    # global sequence count of 4
    ("seq_mean_token_sum_norm", {"max_len": 4, "num_seqs": 4}, (-3 / 4 + 2 / 4) / 4),
])
def test_aggregations(agg, kw, expected):
    logp, mask, adv = _two_seqs()
    logp.requires_grad_()
    loss, _ = policy_loss(logp, logp.detach().clone(), adv, mask, agg=agg, **kw)
    assert close(loss, expected)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[1, 1:] == 0).all()


def test_aggregations_differ_and_errors():
    logp, mask, adv = _two_seqs()
    vals = {a: policy_loss(logp, logp, adv, mask, agg=a, max_len=4)[0].item()
            for a in grpo.AGGREGATIONS}
    assert len({round(v, 6) for v in vals.values()}) == 3
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(logp, logp, adv, mask, agg="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown agg"):
        aggregate(torch.zeros(2, 3), mask, "seq_sum")


def test_aggregate_ignores_padding_values():
    # NaN under mask 0 must not leak: [[1, 2, NaN], [4, NaN, NaN]] with lengths 2 and 1
    #   token_mean (1 + 2 + 4) / 3 = 7/3; seq_mean_token_mean (1.5 + 4) / 2 = 2.75;
    #   sum_norm (3/4 + 4/4) / 2
    nan = float("nan")
    loss_tok = torch.tensor([[1.0, 2.0, nan], [4.0, nan, nan]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert close(aggregate(loss_tok, mask, "token_mean"), 7 / 3)
    assert close(aggregate(loss_tok, mask, "seq_mean_token_mean"), 2.75)
    assert close(aggregate(loss_tok, mask, "seq_mean_token_sum_norm", max_len=4), 0.875)


def test_micro_batches_with_global_counts_sum_to_full_batch():
    logp, mask, adv = _two_seqs()
    for agg, kw in [("token_mean", {"num_tokens": 4}), ("seq_mean_token_mean", {"num_seqs": 2})]:
        full = policy_loss(logp, logp, adv, mask, agg=agg)[0]
        parts = sum(policy_loss(logp[i:i + 1], logp[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                                agg=agg, **kw)[0]
                    for i in range(2))
        assert close(full, parts)


def test_zero_mask_sequence_is_finite():
    # seq 1 has no loss tokens (e.g. a masked truncated sample) and NaN log-probs
    logp = torch.tensor([[LN(1.1), 0.0], [float("nan"), float("nan")]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0], [float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1], [0, 0]])
    for agg in grpo.AGGREGATIONS:
        loss, m = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask, agg=agg, max_len=2,
                              ref_logp=old, beta=0.1, engine_logp=old, tis_cap=2.0)
        assert all(math.isfinite(v) for v in m.values()), m
        logp.grad = None
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    # the empty sequence counts in no denominator: seq_mean_token_mean = seq 0 alone
    # = (-1.1 - 1) / 2
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask, agg="seq_mean_token_mean")
    assert close(loss, -1.05)
    # an all-masked batch gives 0 with a graph, never NaN
    loss, m = policy_loss(logp, old, torch.tensor([1.0, 1.0]), torch.zeros(2, 2), agg="token_mean")
    assert loss.item() == 0.0 and m["tokens"] == 0.0
    loss.backward()


# ----------------------------------------------------------------------------- KL and TIS
def test_kl_k3_to_reference():
    # ref - logp = ln 2:  e^x - x - 1 = 2 - 0.6931472 - 1 = 0.3068528; d/dlogp = 1 - e^x = -1
    # ref - logp = -ln 2: 0.5 + 0.6931472 - 1 = 0.1931472;              d/dlogp = 1 - 0.5 = +0.5
    # A = 0, so loss = beta * token mean = 0.1 * (0.3068528 + 0.1931472) / 2 = 0.1 * 0.25 = 0.025
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0 + LN(2), -1.0 - LN(2)]])
    loss, m = policy_loss(logp, logp.detach().clone(), torch.tensor([0.0]), torch.ones(1, 2),
                          agg="token_mean", ref_logp=ref, beta=0.1)
    assert close(loss, 0.025) and close(m["kl_ref"], 0.25)
    loss.backward()
    assert close(logp.grad, [[-0.05, 0.025]])  # 0.1 * [-1, 0.5] / 2: pulls logp towards ref
    # beta 0 logs the KL but adds nothing; beta > 0 without ref_logp is an error
    loss0, m0 = policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                            ref_logp=ref)
    assert loss0.item() == 0.0 and close(m0["kl_ref"], 0.25)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), beta=0.1)


def test_tis_weight_capping():
    # old_logp - engine_logp = ln 1.5, ln 3, ln 0.5
    #   -> w = min(pi_trainer / pi_engine, 2) = 1.5, 2 (3 capped), 0.5
    # A = +1, ratio 1 -> ppo loss -1 per token -> weighted [-1.5, -2, -0.5], token mean = -4/3
    logp = torch.zeros(1, 3, requires_grad=True)
    engine = torch.tensor([[-LN(1.5), -LN(3.0), -LN(0.5)]], requires_grad=True)
    kw = dict(agg="token_mean", engine_logp=engine)
    loss, m = policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3),
                          tis_cap=2.0, **kw)
    assert close(loss, -4 / 3)
    assert close(m["tis_weight_mean"], (1.5 + 2 + 0.5) / 3) and close(m["tis_capped_frac"], 1 / 3)
    loss.backward()
    assert close(logp.grad, [[-0.5, -2 / 3, -1 / 6]])  # w * (-r*A) / 3
    assert engine.grad is None  # the weight is detached
    # mismatch is logged with or without TIS: mean |ln 1.5|, |ln 3|, |ln 0.5|
    # = (0.4054651 + 1.0986123 + 0.6931472) / 3 = 0.7324082; k3 KL(engine || trainer)
    # = mean(w_raw - ln w_raw - 1)
    off, m_off = policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), **kw)
    assert close(off, -1.0) and close(m_off["mismatch_abs"], 0.7324082)
    # (1.5 - 0.4054651 - 1) + (3 - 1.0986123 - 1) + (0.5 + 0.6931472 - 1)
    # = 0.0945349 + 0.9013877 + 0.1931472
    assert close(m_off["mismatch_kl"], 1.1890698 / 3)
    assert "tis_weight_mean" not in m_off
    with pytest.raises(ValueError, match="engine_logp"):
        policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), tis_cap=2.0)


def test_tis_is_on_by_default_whatever_the_engine():
    # One objective for both engines: the built-in engine samples from the noisy (AQN) policy too,
    # so the correction is on by default with verl's cap C = 2; 0 turns it off, any other value is
    # the cap.
    assert resolve_tis_cap(None) == 2.0
    assert resolve_tis_cap(0) is None and resolve_tis_cap(3.0) == 3.0


def test_importance_weight_metrics():
    # trainer log p - engine log p per token: ln 3 (ratio 3, capped at 2), ln 0.5, 0 (ratio 1);
    # one token masked
    old = torch.tensor([[LN(3.0), LN(0.5), 0.0, 5.0]])
    eng = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, m = policy_loss(old.clone(), old, torch.tensor([1.0]), mask, engine_logp=eng, tis_cap=2.0)
    assert m["tis_weight_mean"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    assert m["tis_weight_max"] == pytest.approx(2.0) and m["is_ratio_max"] == pytest.approx(3.0)
    assert m["tis_capped_frac"] == pytest.approx(1 / 3)


# ----------------------------------------------------------------------------- presets
def test_presets():
    g, d, r = PRESETS["grpo"], PRESETS["dapo"], PRESETS["dr_grpo"]
    assert (g["std_normalize"], g["eps_low"], g["eps_high"]) == (True, 0.2, 0.2)
    assert g["agg"] == "seq_mean_token_mean"
    assert not g["dynamic_sampling"] and g["overlong_cache_frac"] == 0
    assert ((d["std_normalize"], d["eps_low"], d["eps_high"], d["agg"])
            == (True, 0.2, 0.28, "token_mean"))
    assert d["dynamic_sampling"] and d["overlong_cache_frac"] > 0 and d["beta"] == 0
    assert (r["std_normalize"], r["eps_high"], r["agg"]) == (False, 0.2, "seq_mean_token_sum_norm")
    assert not r["dynamic_sampling"]


def test_apply_preset_overrides_and_unknown_algo():
    cfg = apply_preset("dapo", {"eps_high": 0.3, "beta": None, "lr": 1e-5})
    assert (cfg["eps_high"] == 0.3 and cfg["beta"] == 0.0 and cfg["lr"] == 1e-5
            and cfg["algo"] == "dapo")
    assert PRESETS["dapo"]["eps_high"] == 0.28  # the preset itself is untouched
    with pytest.raises(ValueError, match="dapo, dr_grpo, grpo"):
        apply_preset("ppo", {})
