"""train.py's RL step against what verl / TRL / transformers define: dynamic sampling on accuracy,
one objective for both engines (TIS on by default), safe masking, no NaN into the weights, the
minibatch's loss logged, the learning-rate schedule in optimizer steps, and evaluation rows that
are never trained on. CPU, tiny model."""
import json

import pytest
import torch

import grpo
import rollout
from util import tiny
import train
from test_train import run
from trainer import prepare
from trainer.config import Config, Stop
from trainer.schedule import lr_factor


# ----------------------------------------------------------------------------- dynamic sampling
class ScriptedEngine:
    """Returns the same completions for every prompt: `texts` tokenized, finish reason "stop"."""

    def __init__(self, tok, texts):
        self.ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    def generate(self, prompts, n, **kw):
        return [rollout.Sample(i, list(self.ids[g]), [-0.1] * len(self.ids[g]), "stop")
                for i in range(len(prompts)) for g in range(n)]


def test_dynamic_sampling_judges_groups_by_accuracy_not_shaped_reward():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.TOKENIZER_DIR)
    # both correct, the second runs long
    right, long_right = "\\boxed{7}", "\\boxed{7}" + " and so on" * 4
    engine = ScriptedEngine(tok, [right] * 7 + [long_right])
    n_long = len(engine.ids[-1])
    cfg = Config(prompts_per_step=1, group_size=8, max_new_tokens=n_long + 1, format_weight=0.0)
    p = grpo.apply_preset("dapo", dict(max_sample_rounds=1))  # overlong window: the last quarter
    rows = [dict(question="What is the lucky digit?", gold="7", kind="gsm8k")]
    batch, seen, _ = train.sample_batch(cfg, p, 0, engine, tok, rows, stops=[], z=None)
    rewards = seen[0]["rewards"]
    # the overlong penalty made the rewards unequal...
    assert rewards[-1] < rewards[0] == 1.0
    # ...so a filter on the reward keeps the group
    assert grpo.dynamic_sampling_keep(rewards[None]).item()
    # DAPO / verl filter on accuracy: all right, so dropped
    assert batch == []


# ----------------------------------------------------------------------------- one training step
def one_step(tmp_path, name, *args):
    rc, rows, out = run(tmp_path, name, "--steps", "1", "--eval-limit", "4", *args)
    assert rc == 0
    return [r for r in rows if "reward" in r][0], out


def noisy_step(tmp_path, name, *args):
    """The metrics of step 1 of a 2-step run whose second step is an AQN stage (the first has no
    noise)."""
    rc, rows, _ = run(tmp_path, name, "--steps", "2", "--eval-limit", "4", "--aqn",
                      "--aqn-stages", "2", "--sigma-start", "5e-2", "--sigma-end", "5e-2", *args)
    assert rc == 0
    return [r for r in rows if "reward" in r and r["step"] == 1][0]


def test_importance_weights_are_on_and_logged_for_the_builtin_engine(tmp_path):
    # AQN noise is in the rollout only: the engine samples from a noisy policy, the trainer is clean
    m = noisy_step(tmp_path, "tis")
    assert m["sigma"] == 5e-2 and m["mismatch_abs"] > 0
    for k in ("tis_weight_mean", "tis_weight_max", "tis_capped_frac"):
        assert k in m
    assert 0 < m["tis_weight_max"] <= grpo.TIS_CAP
    m = noisy_step(tmp_path, "notis", "--tis-cap", "0")
    assert "tis_weight_mean" not in m and "is_ratio_max" in m


def test_logged_loss_is_the_minibatch_loss_whatever_the_micro_batch(tmp_path):
    # 4 x 8 sequences, 2 minibatches of 16: one micro-batch each, or four of 4 accumulated
    a, _ = one_step(tmp_path, "mb16", "--micro-batch", "16", "--no-aqn")
    b, _ = one_step(tmp_path, "mb4", "--micro-batch", "4", "--no-aqn")
    for k in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl_old",
              "mismatch_abs"):
        assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-6), k
    assert abs(a["loss"]) > 1e-4  # a loss that is really there


def test_all_truncated_batch_with_mask_truncated(tmp_path):
    # One new token cannot close \boxed{...}: every sample is cut at the limit, and all are masked
    m, _ = one_step(tmp_path, "trunc", "--mask-truncated", "--max-new-tokens", "1",
                    "--no-dynamic-sampling")
    assert m["entropy"] == 0.0 and "skipped" not in m


class NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradient backward: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def test_nan_gradient_never_reaches_the_weights(tmp_path, monkeypatch, capsys):
    real, seen = grpo.policy_loss, {"step": 0}
    real_step = train.rl_step

    def counting(cfg, p, step, *a):
        seen["step"] = step
        return real_step(cfg, p, step, *a)

    def nan_grad_at_step_2(lp, *a, **k):
        return real(NanGrad.apply(lp) if seen["step"] >= 2 else lp, *a, **k)

    monkeypatch.setattr(grpo, "policy_loss", nan_grad_at_step_2)
    monkeypatch.setattr(train, "rl_step", counting)
    rc, rows, out = run(tmp_path, "nangrad", "--algo", "grpo", "--steps", "4", "--save-every", "1")
    err = capsys.readouterr().err
    assert rc == 3 and "the gradient norm is nan at step 2" in err
    assert f"the last good checkpoint is {out / 'checkpoints' / 'step_000002'}" in err
    from safetensors.torch import load_file
    adapter = load_file(out / "checkpoints" / "step_000002" / "adapter"
                        / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())
    assert not (out / "checkpoints" / "step_000003").exists()


# ----------------------------------------------------------------------------- learning rate
@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule_matches_transformers(schedule):
    import transformers

    make = {"constant": lambda o, w, t: transformers.get_constant_schedule_with_warmup(o, w),
            "linear": transformers.get_linear_schedule_with_warmup,
            "cosine": transformers.get_cosine_schedule_with_warmup}[schedule]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt, 3, 20)
    for i in range(20):
        assert lr_factor(i, 20, 3, schedule) == pytest.approx(sched.get_last_lr()[0], abs=1e-9), i
        opt.step()
        sched.step()


def test_warmup_counts_optimizer_steps(tmp_path):
    # 2 minibatches a step, warm-up over 4 optimizer steps: the last lr of step s is
    # lr * (2s + 1) / 4
    rc, rows, _ = run(tmp_path, "wu", "--steps", "3", "--minibatches", "2", "--warmup-steps", "4",
                      "--lr", "0.004", "--eval-limit", "4", "--no-dynamic-sampling")
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert rc == 0 and lrs == pytest.approx([0.001, 0.003, 0.004])


# ----------------------------------------------------------------------------- evaluation rows
def gsm8k_file(tmp_path, n):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"})
                            + "\n" for i in range(n)))
    return str(path)


def test_eval_rows_are_never_training_rows(tmp_path):
    cfg = Config(task="gsm8k_train", data=gsm8k_file(tmp_path, 40), eval_limit=8)
    rows, eval_rows = prepare.load_data(cfg)
    assert len(eval_rows) == 8 and len(rows) == 32
    assert not {r["index"] for r in rows} & {r["index"] for r in eval_rows}
    with pytest.raises(Stop, match="fewer than 2 x --eval-limit"):
        prepare.load_data(Config(task="gsm8k_train", data=gsm8k_file(tmp_path, 12), eval_limit=8))


def test_skipped_rows_are_counted(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    good = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n"
                            for r in good + [{"question": "q", "answer": "no gold"}]))
    prepare.load_data(Config(task="gsm8k_train", data=str(path), eval_limit=4))
    assert "20 usable rows of 21 read" in capsys.readouterr().out



# ----------------------------------------------------------------------------- --old-logp reuse
def final_adapter(out):
    from safetensors.torch import load_file

    step = (out / "checkpoints" / "latest").read_text()
    return load_file(str(out / "checkpoints" / step / "adapter" / "adapter_model.safetensors"))


def test_reusing_the_first_minibatchs_forward_as_pi_old_changes_nothing_but_the_work(
        tmp_path, monkeypatch):
    # Before the first optimizer step the policy has not moved, so the first minibatch's training
    # forward IS pi_old (PPO's ratio is 1 there): the update and every metric must match the run
    # that computes pi_old in a separate no-grad pass, while that pass skips the minibatch's rows.
    calls = []
    real = train.ppo.policy_logprobs

    def counted(model, b, idx, *a, **kw):
        calls.append((torch.is_grad_enabled(), len(idx)))
        return real(model, b, idx, *a, **kw)

    monkeypatch.setattr(train.ppo, "policy_logprobs", counted)
    # the CPU path (fp32) on any machine: equal math is what this checks, not bf16 rounding
    args = ("--steps", "2", "--no-aqn", "--save-every", "2", "--device", "cpu")
    a, rows_a, out_a = run(tmp_path, "pass", *args, "--old-logp", "pass")
    pass_calls, calls[:] = list(calls), []
    b, rows_b, out_b = run(tmp_path, "reuse", *args, "--old-logp", "reuse")
    assert a == b == 0
    # 4 prompts x 8 samples, 2 minibatches: the no-grad pass covers 32 rows a step, then 16
    no_grad = lambda cs: sum(n for g, n in cs if not g)            # noqa: E731
    assert no_grad(pass_calls) - no_grad(calls) == 2 * 16
    wa, wb = final_adapter(out_a), final_adapter(out_b)
    for k in wa:
        # an update moves each weight by about lr x optimizer steps = 2e-2; the two pi_old
        # formulas (log_softmax without gradient, logsumexp with) differ in the last bits
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5)
    ra = [r for r in rows_a if "reward" in r]
    rb = [r for r in rows_b if "reward" in r]
    for x, y in zip(ra, rb):
        # mismatch_abs, the mean |log pi_old - log pi_engine|: the no-grad pass runs the engine's
        # inference GEMMs (1e-7 from it), the training forward the autograd ones (2e-5 here);
        # both far below the mismatch the metric is logged to catch (1.1e-3 to 1.4e-3 in the
        # countdown ablation's runs)
        for k in ("reward", "loss", "entropy", "ratio_mean", "approx_kl_old"):
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-5), k
        assert y["mismatch_abs"] == pytest.approx(x["mismatch_abs"], abs=1e-4)


def test_pi_old_pass_with_every_row_skipped_runs_no_forward():
    # --old-logp reuse where the first minibatch is the whole batch (a step that dynamic sampling
    # left with few groups): the pass has no row left, makes no forward, and returns zeros
    S, T = 4, 3
    b = dict(ids=torch.zeros(S, 5, dtype=torch.long), mask=torch.ones(S, T))

    def no_model(*a, **k):
        raise AssertionError("a forward over no rows")
    lp, ent, n = train.ppo.batch_logprobs(no_model, b, 1.0, 2, skip=torch.arange(S))
    assert lp.shape == (S, T) and lp.dtype == torch.float32 and not lp.any()
    assert (ent, n) == (0.0, 0.0)


def test_reusing_pi_old_needs_one_epoch(tmp_path, capsys):
    rc, _, _ = run(tmp_path, "x", "--old-logp", "reuse", "--epochs", "2")
    assert rc != 0
    err = capsys.readouterr().err
    assert "--old-logp reuse needs --epochs 1" in err and "\n" not in err.strip()


@pytest.mark.parametrize("flags, want", [((), "reuse"), (("--epochs", "2"), "pass"),
                                         (("--old-logp", "pass"), "pass")])
def test_old_logp_default_reuses_where_one_epoch_allows(flags, want):
    # left out, --old-logp is reuse with one epoch (the pass it saves: 8-12% of the 7B train
    # half, bench train --old-logp both) and pass with more, where reuse is refused; the saved
    # config holds the choice, and --help says it instead of "(default: None)"
    from trainer import config as tc
    cfg = tc.apply_model_defaults(tc.parse_args(list(flags))[0])
    assert cfg.old_logp == want
    tc.check_config(cfg)
    text = tc.build_parser().format_help()
    assert "default: None" not in text and "default: reuse with --epochs 1" in text


# ------------------------------------------------------------------------ gradient checkpointing
def test_gradient_checkpointing_follows_the_measured_room(monkeypatch):
    from trainer import prepare

    cfg = Config(micro_batch=8, max_new_tokens=512)
    gpu = torch.device("cuda")
    GB = 2**30
    # what the probe found: (activation bytes kept, bytes free)
    for found, on in (((40 * GB, 70 * GB), False),     # 7B on an 80 GB H100: 42 GB peak, fits
                      ((65 * GB, 70 * GB), True),      # past the headroom
                      ((None, 70 * GB), True)):        # ran out of memory
        monkeypatch.setattr(prepare, "activation_probe", lambda *a, f=found: f)
        got, why = prepare.choose_grad_checkpoint(cfg, None, 768, gpu)
        assert got is on and why.startswith("on" if on else "off"), why
        assert "8 x 768 tokens" in why
    # on a CPU: on, as before, without a probe
    monkeypatch.setattr(prepare, "activation_probe", lambda *a: pytest.fail("probed on a CPU"))
    assert prepare.choose_grad_checkpoint(cfg, None, 768, torch.device("cpu"))[0] is True


def test_a_real_models_run_says_and_saves_its_checkpointing(make_checkpoint, tmp_path, capsys):
    # --model FOLDER without a recipe: the real-model defaults, whose checkpointing is decided at
    # the start (on a CPU: on) and saved resolved, so --resume does not decide it again
    out = tmp_path / "real"
    rc = train.main(["--model", str(make_checkpoint("qwen2")), "--task", "synthetic", "--steps",
                     "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
                     "--eval-limit", "2", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    assert "grad checkpoint: on (the default on a CPU)" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["grad_checkpoint"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the probe measures GPU memory")
def test_the_activation_probe_measures_and_leaves_the_model_as_it_was(make_checkpoint):
    import lora
    import model as M
    from trainer import prepare

    m = M.Model.from_pretrained(str(make_checkpoint("qwen2")), torch.device("cuda"),
                                torch.bfloat16)
    lora.add_lora(m, 8, 16)
    m.grad_checkpoint = True
    small, free = prepare.activation_probe(m, 2, 64, 16, 1.0)
    big, _ = prepare.activation_probe(m, 8, 64, 16, 1.0)
    assert 0 < small < big < free            # activations grow with the micro-batch
    assert m.grad_checkpoint is True and not m.training
    assert all(q.grad is None for q in lora.lora_parameters(m))


def test_the_train_halfs_matrix_work_counts_every_weight(make_checkpoint):
    # The benchmark's limit for the train half (bench/model_speed.train_flops) against the usual
    # count, 2 FLOP a weight a token, taken from the model's own tensors, plus causal attention
    # summed position by position
    import model as M
    from bench.model_speed import train_flops

    m = M.Model.from_pretrained(str(make_checkpoint("qwen2")), torch.device("cpu"),
                                torch.float32)
    c = m.cfg
    linears = sum(lin.in_features * lin.out_features for _, lin in m.linears())
    head = c.hidden_size * c.vocab_size
    S, L, T = 3, 40, 16
    q = c.num_heads * c.head_dim
    # token i attends to i + 1 keys: QK^T and PV, 2 FLOP each a (key, channel)
    attn = c.num_layers * S * sum(2 * 2 * (i + 1) * q for i in range(L))
    fwd = 2 * linears * S * L + attn + 2 * head * S * T
    w = train_flops(c, S, L, T)
    assert w["forward"] == pytest.approx(fwd, rel=0.03)
    # pi_old + the training forward + a backward of dX only (the linears and the head once,
    # attention twice)
    assert w["needed"] == pytest.approx(3 * fwd + attn, rel=0.03)
    # --old-logp reuse with 2 minibatches: pi_old's forward over half the rows
    half = train_flops(c, S, L, T, pi_old_share=0.5)
    assert half["needed"] == pytest.approx(2.5 * fwd + attn, rel=0.03)
