"""ablation_report.py: the measures of the QeRL ablation's runs, arms and pairs of arms, the claims
and their verdicts, and the report's tables and figures (experiments/qerl_ablation.py writes them;
the statistics are stats.py's). numpy, matplotlib and the standard library only.

    python experiments/qerl_ablation.py --out runs/ablation --report-only     # this, on the runs

Measures, fixed before any run (README, "Does quantization noise help?"):
- primary: the area under the training-reward curve, as the mean reward over all steps
  (`reward_auc`);
- the steps to 50% and 90% of the bf16 arm's final gain: the first step whose trailing mean reward
  over WINDOW_GAIN steps reaches R0 + f (R1 - R0), R0 and R1 the bf16 arm's mean reward over its
  first 5 and last 20 steps (at its own learning rate, over the verdict seeds); a run that never
  reaches it is counted apart;
- held-out greedy accuracy at the end, and pass@1 / pass@k from the post-run samples after the
  last step; the policy's entropy at every step (train.py's `entropy`), its mean over the steps
  (compared, no claim rests on it), and before any update (the probe);
- collapse: a run whose training accuracy or format rate over its last 20 steps fell below half
  of its own over its first 5 steps (a fall, not a low level). Collapsed runs are counted per arm
  and shown apart; the paired comparisons keep them (a collapse is an outcome of the arm).
Claims (CLAIMS) are judged on the primary measure (the entropy claim on the probe), paired by seed,
at each arm's own learning rate and, where both arms ran it, at each learning rate.
Leaves out: multiple-comparison corrections (the claims are few and fixed before the runs).
"""
import io
import math

import stats

# The claims, fixed before any run: (claim, arm a, arm b, the per-seed measure of a - b)
CLAIMS = [
    ("NVFP4 raises the policy's entropy before any update", "nvfp4", "bf16", "entropy0"),
    ("reward rises faster with NVFP4 than with bf16", "nvfp4", "bf16", "reward_auc"),
    ("QeRL (NVFP4 + AQN 1e-2) beats bf16 + LoRA", "nvfp4_aqn", "bf16", "reward_auc"),
    ("AQN (QeRL's 1e-2) helps on top of NVFP4", "nvfp4_aqn", "nvfp4", "reward_auc"),
    ("AQN at 1e-1 helps on top of NVFP4", "nvfp4_aqn_1e-1", "nvfp4", "reward_auc"),
    ("AQN at 3e-1 helps on top of NVFP4", "nvfp4_aqn_3e-1", "nvfp4", "reward_auc"),
    ("noise alone helps: bf16 + AQN 1e-2 beats bf16", "bf16_aqn", "bf16", "reward_auc"),
    ("noise alone helps: bf16 + AQN at NVFP4's KL beats bf16", "bf16_aqn_7e-2", "bf16",
     "reward_auc"),
    ("TIS helps the noisy NVFP4 arm", "nvfp4_aqn", "nvfp4_aqn_notis", "reward_auc"),
]
# every pair is compared on every measure of MEASURES
PAIRS = [(a, b) for _, a, b, _ in CLAIMS[1:]]
MEASURES = {"entropy0": "entropy before any update (probe)",
            "reward_auc": "mean reward over all steps",
            "acc_auc": "mean sampled accuracy over all steps",
            "entropy_auc": "mean entropy of the sampled tokens over all steps",
            "final_acc": "final held-out greedy accuracy",
            "pass1_final": "final held-out pass@1 (sampled)",
            "passk_final": "final held-out pass@k (largest k)"}
WINDOW = 5        # steps in the trailing mean of sampled accuracy that the sampled threshold judges
WINDOW_GAIN = 10  # steps in the trailing mean of reward that the 50% / 90% gain thresholds judge
HEAD, TAIL = 5, 20  # the first and last steps that R0, R1 and the collapse rule average
RULE = ("Rule: each claim compares two arms on the same seeds (paired: same data order and "
        "sampling draws). It is **supported** if the 95% t-interval of the mean per-seed "
        "difference a - b lies above 0, **refuted** if it lies below 0, **inconclusive** if it "
        "holds 0 or fewer than 2 seeds are paired. The exact sign-flip p-value is shown beside "
        "it (with n seeds it cannot go below 2 / 2^n: 0.0625 at 5), and the smallest difference "
        "this many seeds detect with 80% probability at the measured spread (`detectable`: a true "
        "effect that large would have shown 4 times in 5). Each claim's measure was "
        "fixed before any run: the entropy probe before any update for the first, the mean "
        "reward over all steps (the area under the reward curve) for the others.")


def _mean(xs) -> float:
    ok = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(ok) / len(ok) if ok else math.nan


# --------------------------------------------------------------------------------------------------
# One run, then per arm x lr over seeds, then paired between arms

def run_measures(steps: int, rows: list[dict], evals: dict, post: dict, thr_greedy: float,
                 thr_sampled: float, window: int = WINDOW) -> dict:
    """One finished run's numbers. rows: train.py's metrics.jsonl (the rows with "reward" are
    training steps 0 .. steps-1, the rollout of step s made after s updates); evals: {step: greedy
    held-out accuracy}; post: the post-run evaluations ({} when missing)."""
    train = {r["step"]: r for r in rows if "reward" in r}  # a step logged twice keeps its last row

    def col(k):
        return [float(train.get(s, {}).get(k, math.nan)) for s in range(steps)]
    reward, acc, fmt = col("reward"), col("accuracy"), col("format_rate")
    e_steps = sorted(evals)
    final = post.get("pass_at_k", {}).get(str(steps), {})
    ks = sorted(int(k[5:]) for k in final if k.startswith("pass@") and not k.endswith("ci95"))
    fell = [_mean(c[-TAIL:]) < 0.5 * _mean(c[:HEAD]) for c in (acc, fmt)]
    collapsed = any(fell)
    entropy = col("entropy")
    return dict(steps=steps, reward=reward, accuracy=acc, entropy=entropy, evals=evals,
                entropy0=post.get("entropy_probe"), entropy0_noisy=post.get("entropy_probe_noisy"),
                entropy0_trainer=train.get(0, {}).get("entropy"), reward_auc=_mean(reward),
                acc_auc=_mean(acc), entropy_auc=_mean(entropy), reward_head=_mean(reward[:HEAD]),
                reward_tail=_mean(reward[-TAIL:]), collapsed=collapsed,
                final_acc=evals.get(steps), pass1_final=final.get("pass@1"),
                passk_final=final.get(f"pass@{ks[-1]}") if ks else None,
                k_final=ks[-1] if ks else None, mismatch=_mean(col("mismatch_abs")),
                tis_capped=_mean(col("tis_capped_frac")),
                steps_greedy=stats.first_reach(e_steps, [evals[s] for s in e_steps], thr_greedy),
                steps_sampled=stats.first_reach(list(range(steps)), acc, thr_sampled, window),
                pass_at_k=post.get("pass_at_k", {}), device=post.get("device"))


def writes(samples: list[dict], n: int = 2) -> dict:
    """What a run wrote at its last held-out evaluation (train.py's samples.jsonl rows): its first
    n answers, and the share of answers that box the gold answer yet are refused (Countdown: the
    target reached by false arithmetic, which the checker refuses; 0 where the answer alone is
    checked). Descriptive: no claim is decided on it."""
    def gold_answer(r):
        return str(r.get("gold", "")).split(" ")[0]          # "96 from 3,10,..." -> "96"
    refused = [r for r in samples
               if not r.get("correct") and r.get("pred") and r["pred"] == gold_answer(r)]
    return dict(examples=[dict(question=r.get("question"), response=r.get("response", ""),
                               correct=bool(r.get("correct"))) for r in samples[:n]],
                gold_refused=len(refused) / len(samples) if samples else None)


def gain_steps(runs: dict, ref: tuple) -> dict:
    """Add steps_50 / steps_90 to every finished run: the first step whose trailing mean reward
    (WINDOW_GAIN steps) reaches R0 + f (R1 - R0), R0 and R1 the mean first-5 and last-20 rewards of
    the reference (arm, lr)'s runs. Returns the reference's numbers."""
    refs = [r["summary"] for k, r in runs.items() if k[:2] == ref and r["summary"]]
    if not refs:
        return {}
    r0 = _mean([s["reward_head"] for s in refs])
    r1 = _mean([s["reward_tail"] for s in refs])
    for r in runs.values():
        s = r["summary"]
        if s:
            for f in (0.5, 0.9):
                level = r0 + f * (r1 - r0)
                s[f"steps_{round(100 * f)}"] = stats.first_reach(
                    list(range(s["steps"])), s["reward"], level, WINDOW_GAIN)
    return dict(arm=ref[0], lr=ref[1], r0=r0, r1=r1, gain=r1 - r0)


def aggregate(runs: dict, arms, lrs, seeds) -> dict:
    """Per arm x lr ("arm@lr") that has runs: each measure's mean with its t-interval over seeds,
    the counts of collapsed runs and of runs reaching each threshold, and the curves' bands. runs:
    (arm, lr, seed) -> dict(summary=run_measures(...) or None when unfinished, timing={...})."""
    groups = {}
    for arm in arms:
        for lr in lrs:
            planned = [s for s in seeds if (arm, lr, s) in runs]
            if not planned:
                continue
            done = [s for s in planned if runs[(arm, lr, s)]["summary"]]
            ss = [runs[(arm, lr, s)]["summary"] for s in done]
            gpu = sum(runs[(arm, lr, s)]["timing"].get("gpu_seconds", 0) for s in planned) / 60
            g = dict(arm=arm, lr=lr, seeds=done, planned=len(planned), gpu_minutes=gpu,
                     collapsed=[s for s, x in zip(done, ss) if x["collapsed"]])
            for k in ("entropy0", "entropy0_trainer", "entropy0_noisy", "reward_auc", "acc_auc",
                      "entropy_auc", "final_acc", "pass1_final", "passk_final", "mismatch",
                      "tis_capped"):
                g[k] = stats.mean_ci([x[k] for x in ss])
            g["gold_refused"] = stats.mean_ci([(x.get("writes") or {}).get("gold_refused")
                                               for x in ss])
            kept = [x["reward_auc"] for x in ss if not x["collapsed"]]
            g["reward_auc_kept"] = stats.mean_ci(kept)
            g["k_final"] = max((x["k_final"] or 0 for x in ss), default=0)
            # seeds that never reach a threshold have no step: they are counted apart
            for k in ("steps_greedy", "steps_sampled", "steps_50", "steps_90"):
                hit = sorted(x[k] for x in ss if x.get(k) is not None)
                median = hit[len(hit) // 2] if hit else None
                g[k] = dict(reached=len(hit), of=len(ss), median=median)
            if ss:
                T = min(x["steps"] for x in ss)
                g["curves"] = {k: [list(map(float, c)) for c in stats.band([x[k][:T] for x in ss])]
                               for k in ("reward", "accuracy", "entropy")}
                common = set.intersection(*[set(x["evals"]) for x in ss])
                g["evals"] = {s: stats.mean_ci([x["evals"][s] for x in ss]) for s in sorted(common)}
            groups[f"{arm}@{lr:g}"] = g
    return groups


def compare(runs: dict, arms, lrs, seeds, best: dict | None = None) -> tuple[list, list]:
    """Paired comparisons a - b of every PAIRS pair x measure, and the CLAIMS' verdicts: at each
    arm's own learning rate (`best`: {arm: lr}, when both arms have one) and at each learning rate
    both arms ran."""
    def value(arm, lr, k):
        return {s: runs[(arm, lr, s)]["summary"].get(k) for s in seeds
                if (arm, lr, s) in runs and runs[(arm, lr, s)]["summary"]}

    def settings(a, b):
        out = []
        if best and a in best and b in best:
            text = f"own ({a} {best[a]:g}, {b} {best[b]:g})"
            out.append((text, best[a], best[b]))
        for lr in lrs:
            if value(a, lr, "reward_auc") and value(b, lr, "reward_auc"):
                out.append((f"{lr:g}", lr, lr))
        return out

    comps, verdicts = [], []
    for a, b in PAIRS:
        if a in arms and b in arms:
            for text, la, lb in settings(a, b):
                for k in MEASURES:
                    comps.append(dict(a=a, b=b, lr_text=text, measure=k,
                                      **stats.paired(value(a, la, k), value(b, lb, k))))
    for claim, a, b, k in CLAIMS:
        if a in arms and b in arms:
            for text, la, lb in settings(a, b):
                verdicts.append(dict(claim=claim, a=a, b=b, lr_text=text, measure=k,
                                     **stats.paired(value(a, la, k), value(b, lb, k))))
    return comps, verdicts


# --------------------------------------------------------------------------------------------------
# results.md's tables and the figures

def ci_text(c: dict, digits: int = 3) -> str:
    if not c["n"]:
        return "-"
    interval = f" [{c['lo']:.{digits}f}, {c['hi']:.{digits}f}]" if c["n"] > 1 else ""
    return f"{c['mean']:.{digits}f}" + interval


def figure(groups: dict, labels: dict, keys: dict, title: str) -> bytes:
    """A PNG of the arms' groups (keys: arm -> "arm@lr", labels: arm -> label): the training
    curves with bands, and the held-out greedy evaluations as markers with bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    panels = [("reward", "reward (training batch)"),
              ("accuracy", "sampled accuracy (training prompts)"),
              ("entropy", "entropy of the sampled tokens (nats)"),
              ("evals", "held-out greedy accuracy")]
    for ax, (key, name) in zip(axes.flat, panels):
        for i, (arm, label) in enumerate(labels.items()):
            g = groups.get(keys.get(arm, ""))
            if not g or not g["seeds"]:
                continue
            kw = dict(color=f"C{i}", label=f"{label}, lr {g['lr']:g} (n={len(g['seeds'])})")
            if key in g["curves"]:
                mean, lo, hi = g["curves"][key]
                ax.plot(range(len(mean)), mean, linewidth=1.2, **kw)
                ax.fill_between(range(len(mean)), lo, hi, color=kw["color"], alpha=0.12,
                                linewidth=0)
                continue
            # markers only: a line between two evaluations would suggest what was never measured
            xs = sorted(g["evals"])
            m, lo, hi = ([g["evals"][s][q] for s in xs] for q in ("mean", "lo", "hi"))
            err = [[y - a if math.isfinite(a) else 0 for y, a in zip(m, lo)],
                   [b - y if math.isfinite(b) else 0 for y, b in zip(m, hi)]]
            # the arms side by side
            xs = [x + 0.01 * max(xs[-1] if xs else 1, 1) * (i - len(labels) / 2) for x in xs]
            ax.errorbar(xs, m, yerr=err, fmt="o", capsize=3, **kw)
        ax.set(title=name, xlabel="RL step (updates made)")
        ax.grid(alpha=0.3)
    if axes.flat[0].get_legend_handles_labels()[0]:  # no finished run yet: no legend
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{title}: mean over seeds; bands and bars: 95% t-interval")
    return _png(fig)


def claims_figure(claims: list[dict]) -> bytes | None:
    """A PNG of the reward claims: each one's mean paired difference with its 95% interval (a row
    per claim and learning rate, a row once where two settings gave the same pairs), coloured by
    verdict; the zero line is "no effect". None without a reward claim that has an interval."""
    rows, seen = [], set()
    for c in claims:
        key = (c["a"], c["b"], tuple(c["diffs"]))
        if c["measure"] != "reward_auc" or c["n"] < 2 or key in seen:
            continue
        seen.add(key)
        rows.append(c)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colour = {"supported": "C2", "refuted": "C3", "inconclusive": "C7"}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.2))
    for y, c in enumerate(reversed(rows)):
        ax.errorbar([c["mean"]], [y], xerr=[[c["mean"] - c["lo"]], [c["hi"] - c["mean"]]],
                    fmt="o", capsize=3, color=colour[c["verdict"]])
    ax.set_yticks(range(len(rows)), [f"{c['a']} - {c['b']}, " + (
        "own lrs" if c["lr_text"].startswith("own") else f"lr {c['lr_text']}")
        for c in reversed(rows)], fontsize=8)
    ax.axvline(0.0, color="k", linewidth=0.8)
    ax.set(xlabel="a - b: mean reward over all steps, paired by seed (95% t-interval)",
           title="the claims: green supported, red refuted, grey inconclusive")
    ax.grid(alpha=0.3, axis="x")
    return _png(fig)


def _png(fig) -> bytes:
    """The figure as PNG bytes (laid out, 80 dpi), closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


def _p(c) -> str:
    return "-" if c["p"] is None else f"{c['p']:.4g}"


def _detect(c) -> str:
    """The smallest detectable difference; results made before it was measured have none."""
    d = c.get("detectable")
    return "-" if d is None or not math.isfinite(d) else f"{d:.4f}"


def _reached(r: dict) -> str:
    return f"{r['median']} ({r['reached']}/{r['of']})" if r["reached"] else f"- (0/{r['of']})"


def markdown(res: dict) -> str:
    """results.md from results.json's content."""
    cfg, groups = res["config"], res["groups"]
    rc = next((r["config"] for r in res["runs"].values() if r.get("config")), {})
    kind = res["device_kind"]
    head = (f"Model `{rc.get('model')}`, task `{rc.get('task')}`, {rc.get('algo')}, "
            f"{rc.get('steps')} steps of {rc.get('prompts_per_step')} prompts x "
            f"{rc.get('group_size')} samples, {rc.get('eval_limit')} held-out prompts; learning "
            f"rates {', '.join(f'{x:g}' for x in cfg['lrs'])}; verdict seeds {cfg['seeds']}; "
            f"selection seeds {cfg.get('select_seeds') or '-'}; train.py flags "
            f"`{' '.join(cfg['train_flags']) or '(none)'}`; devices "
            f"{', '.join(res['devices']) or '-'}. Finished runs: {res['finished']} of "
            f"{len(res['runs'])}.")
    L = ["# Does quantization noise help? The QeRL ablation", "", head, ""]
    if res.get("selection"):
        L += ["## Learning rates", "", "Each arm's learning rate: the highest mean area under the "
              "training-reward curve over the selection seeds (the smaller on a tie).", "",
              "| arm | " + " | ".join(f"mean AUC at {x:g}" for x in cfg["lrs"]) + " | chosen |",
              "|---" * (len(cfg["lrs"]) + 2) + "|"]
        for arm, s in res["selection"].items():
            aucs = [f"{s['mean_auc'][f'{x:g}']:.4f}" for x in cfg["lrs"]]
            L.append(f"| {res['arms'][arm]['label']} | " + " | ".join(aucs) + f" | {s['lr']:g} |")
        L.append("")
    L += ["## Conclusions, as measured", "", RULE, "",
          "| claim | lr | a - b: measure | pairs | mean difference [95% CI] | sign-flip p | "
          "detectable | verdict |", "|---" * 8 + "|"]
    L += [f"| {c['claim']} | {c['lr_text']} | {c['a']} - {c['b']}: {MEASURES[c['measure']]} | "
          f"{c['n']} | {ci_text(c, 4)} | {_p(c)} | {_detect(c)} | **{c['verdict']}** |"
          for c in res["claims"]]
    if not res["claims"]:
        L.append("| (no claim has finished runs of both its arms yet, or both its arms in --arms) |"
                 + " |" * 7)
    gain = res.get("gain") or {}
    gain_text = (f"R0 {gain['r0']:.3f}, R1 {gain['r1']:.3f} ({gain['arm']} at lr {gain['lr']:g})"
                 if gain else "-")
    L += ["", "## Arms", "", "Mean over the verdict seeds [95% t-interval]. Entropy (nats a "
          "token): the probe (the policy's own samples on the held-out prompts, before any "
          "update), the trainer's at step 0, the probe at sigma_start (AQN arms). Steps: median "
          "over the seeds that reached it (reached / seeds); greedy >= "
          f"{cfg['threshold_greedy']} at the evaluation steps, 50% / 90% of the bf16 arm's gain "
          f"({gain_text}) as a trailing mean of {WINDOW_GAIN} steps. pass@k: "
          f"{cfg['pass_k_n']} samples a prompt at T = {cfg['pass_temperature']} after the last "
          "step. Collapsed: seeds whose accuracy or format rate over the last 20 steps fell "
          "below half of their own over the first 5; AUC kept: the mean AUC without them. "
          f"{kind}-min: wall time x device share.", "",
          "| arm | lr | seeds | collapsed | entropy probe | trainer's | probe, noisy | mean reward "
          "(AUC) | AUC kept | final greedy acc | pass@1 | pass@k | steps to greedy | to 50% | "
          f"to 90% | mismatch | TIS capped | {kind}-min |", "|---" * 18 + "|"]
    for g in groups.values():
        cells = [f"| {res['arms'][g['arm']]['label']}", f"{g['lr']:g}",
                 f"{len(g['seeds'])}/{g['planned']}", str(len(g["collapsed"]))]
        cells += [ci_text(g[x]) for x in ("entropy0", "entropy0_trainer", "entropy0_noisy",
                                          "reward_auc", "reward_auc_kept", "final_acc",
                                          "pass1_final")]
        cells += [ci_text(g["passk_final"]) + f" (k={g['k_final']})"]
        cells += [_reached(g[x]) for x in ("steps_greedy", "steps_50", "steps_90")]
        cells += [ci_text(g["mismatch"], 5), ci_text(g["tis_capped"]),
                  f"{g['gpu_minutes']:.1f} |"]
        L.append(" | ".join(cells))
    L += writes_section(res)
    L += ["", "## Paired comparisons", "", "Mean per-seed difference a - b [95% t-interval], "
          "sign-flip p, the smallest difference detectable with 80% probability, and what the "
          "rule above says of it.", "",
          "| a - b | lr | measure | pairs | difference | p | detectable | verdict |",
          "|---" * 8 + "|"]
    L += [f"| {c['a']} - {c['b']} | {c['lr_text']} | {MEASURES[c['measure']]} | {c['n']} | "
          f"{ci_text(c, 4)} | {_p(c)} | {_detect(c)} | {c['verdict']} |"
          for c in res["comparisons"]]
    gm = res["gpu_minutes"]
    per_arm = ", ".join(f"{a} {m:.1f}" for a, m in gm["per_arm"].items())
    parts = ", ".join(f"{p} {m:.1f}" for p, m in gm.get("held_per_part", {}).items())
    L += ["", "## Time", "", f"{kind}-minutes per arm (wall time x device share, every attempt): "
          f"{per_arm}; in all **{gm['total']:.1f}**. Machine time held (each invocation's wall "
          f"time x its devices): {gm['held']:.1f} minutes" + (f" ({parts})" if parts else "")
          + ".", "", "## Figures", ""]
    L += [f"![{name}]({name}.png)" for name in res.get("figures", [])]
    missing = [f"- {n}: {r['error'] or 'not run yet'}" for n, r in res["runs"].items()
               if not r.get("config")]
    if missing:
        L += ["", "## Runs without results", ""] + missing
    return "\n".join(L) + "\n"


def writes_section(res: dict) -> list[str]:
    """results.md's "What the arms write": for each arm x lr, the share of final greedy answers
    that box the gold answer yet are refused, and the first answers of its lowest finished
    seed."""
    L = ["", "## What the arms write", "", "At the last held-out evaluation (greedy): the share of "
         "answers that box the gold answer but are refused (Countdown: the target reached by "
         "false arithmetic), mean over the seeds [95% t-interval], and the first two answers of "
         "the lowest finished seed (descriptive; no claim rests on it).", ""]
    for name, g in res["groups"].items():
        mine = sorted((r for r in res["runs"].values()
                       if f"{r['arm']}@{r['lr']:g}" == name and r["phase"] == "verdict"
                       and (r.get("writes") or {}).get("examples")), key=lambda r: r["seed"])
        if not mine:
            continue
        w = mine[0]["writes"]
        L.append(f"- **{res['arms'][g['arm']]['label']}, lr {g['lr']:g}**: gold boxed but "
                 f"refused {ci_text(g.get('gold_refused') or dict(n=0))}; seed {mine[0]['seed']}:")
        for e in w["examples"]:
            answer = e["response"].strip().replace("\n", " / ")
            L.append(f"  - {e['question']} `{answer}` "
                     f"({'right' if e['correct'] else 'refused'})")
    return L if len(L) > 5 else []


def clean(x):
    """JSON without NaN (not valid JSON): nan and inf become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    return [clean(v) for v in x] if isinstance(x, (list, tuple)) else x
