"""stats.py: the analysis of the QeRL ablation (experiments/qerl_ablation.py runs it): the statistics, the measures of
each run, arm and pair of arms, the claims and their verdicts, and the report's tables and figures. numpy, matplotlib
and the standard library only.

    python experiments/stats.py 0.12 0.30 -0.05 0.21 0.18      # a paired comparison of these per-seed differences

- `t_ppf`: quantiles of Student's t, from its CDF through the regularized incomplete beta function (a continued
  fraction, Lentz's method) and bisection; no scipy needed.
- `mean_ci`: the mean over seeds with a 95% t-interval (mean +- t(0.975, n-1) * sd / sqrt(n)); `band` the same per
  step for curves (seeds x steps).
- `sign_flip_p`: the paired permutation test. Under "no difference between the arms" each seed's difference is as
  likely to have either sign, so the p-value is the share of the 2^n sign patterns whose mean is at least as far from
  0 as the observed one: exact up to 20 seeds, 2^20 seeded random patterns beyond. With n seeds it cannot go below
  2 / 2^n (0.0625 at 5 seeds), which is why the verdicts rest on the interval, not on the p-value.
- `verdict`: "supported" when the 95% interval of the paired mean difference lies above 0, "refuted" when it lies
  below 0, "inconclusive" when it holds 0 (or there are fewer than 2 pairs).
- `run_measures` (one run), `aggregate` (arm x lr over seeds), `compare` (PAIRS and CLAIMS, paired by seed);
  `markdown` and `figure` write results.md and one PNG per learning rate.
Leaves out: multiple-comparison corrections (the claims are few and fixed before the runs), bootstrap intervals.
"""
import functools
import math
import sys

import numpy as np

EXACT_MAX = 20  # up to this many pairs the sign-flip test enumerates every pattern (2^20 = 1M rows of n signs)


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),            # the even term, then the odd one
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0 and x in [0, 1]."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use the symmetry on the other
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (bisection on t_cdf to 1e-12)."""
    if not 0.0 < q < 1.0 or df <= 0:
        raise ValueError(f"t_ppf needs 0 < q < 1 and df > 0, got q={q}, df={df}")
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_ci(xs, level: float = 0.95) -> dict:
    """n, mean, sd and the t-interval [lo, hi] of the mean; lo and hi are nan below 2 values."""
    x = np.asarray([v for v in xs if v is not None and math.isfinite(v)], dtype=float)
    n = len(x)
    if n == 0:
        return dict(n=0, mean=math.nan, sd=math.nan, lo=math.nan, hi=math.nan)
    mean = float(x.mean())
    if n < 2:
        return dict(n=1, mean=mean, sd=math.nan, lo=math.nan, hi=math.nan)
    sd = float(x.std(ddof=1))
    half = t_ppf(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return dict(n=n, mean=mean, sd=sd, lo=mean - half, hi=mean + half)


def band(rows, level: float = 0.95):
    """Per-step mean and t-interval over seeds: rows (seeds, steps), nan where a seed has no value -> mean, lo, hi,
    each (steps,). A step with one value has the value as its band; with none, nan."""
    y = np.asarray(rows, dtype=float)                                           # (S, T)
    ok = np.isfinite(y)
    n = ok.sum(0)                                                               # (T,) values per step
    mean = np.where(ok, y, 0.0).sum(0) / np.maximum(n, 1)                       # (T,)
    var = np.where(ok, (y - mean) ** 2, 0.0).sum(0) / np.maximum(n - 1, 1)     # (T,)
    t = np.array([_t975(k - 1, level) if k >= 2 else 0.0 for k in n])         # (T,)
    half = t * np.sqrt(var / np.maximum(n, 1))                                  # (T,)
    mean = np.where(n > 0, mean, np.nan)
    return mean, mean - half, mean + half


@functools.lru_cache(maxsize=None)
def _t975(df: int, level: float) -> float:  # bands ask for the same few quantiles at every step
    return t_ppf(0.5 + level / 2.0, df)


def sign_flip_p(diffs, seed: int = 0) -> float:
    """Two-sided paired permutation (sign-flip) p-value of the mean difference (see the module docstring)."""
    d = np.asarray(diffs, dtype=float)                                          # (n,)
    n = len(d)
    if n == 0:
        return math.nan
    observed = abs(d.mean())
    if n <= EXACT_MAX:
        bits = (np.arange(2 ** n)[:, None] >> np.arange(n)) & 1                 # (2^n, n): every pattern once
        means = (1 - 2 * bits) @ d / n                                          # (2^n,)
        return float(np.mean(np.abs(means) >= observed - 1e-12))
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(2 ** 20, n))                          # (B, n)
    hits = np.sum(np.abs(signs @ d / n) >= observed - 1e-12)
    return float((1 + hits) / (1 + len(signs)))  # the observed pattern counts as one draw


def verdict(lo: float, hi: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    return "supported" if lo > 0 else "refuted" if hi < 0 else "inconclusive"


def paired(a: dict, b: dict) -> dict:
    """Compare arm a with arm b over the seeds both have ({seed: value}): the mean difference a - b with its 95%
    t-interval, the sign-flip p-value, its smallest possible value at this many pairs, and the verdict."""
    ok = lambda v: v is not None and math.isfinite(v)  # noqa: E731
    seeds = sorted(s for s in set(a) & set(b) if ok(a[s]) and ok(b[s]))
    diffs = [a[s] - b[s] for s in seeds]
    ci = mean_ci(diffs)
    return dict(seeds=seeds, diffs=diffs, n=ci["n"], mean=ci["mean"], lo=ci["lo"], hi=ci["hi"],
                p=sign_flip_p(diffs), min_p=(2.0 / 2 ** len(diffs) if 0 < len(diffs) <= EXACT_MAX else None),
                verdict=verdict(ci["lo"], ci["hi"]))


def first_reach(steps, values, threshold: float, window: int = 1):
    """The first step whose trailing mean over `window` values reaches `threshold` (None: never). The first
    window - 1 steps have no full window and are not judged."""
    v = list(values)
    for i in range(window - 1, len(v)):
        if sum(v[i - window + 1:i + 1]) / window >= threshold:
            return steps[i]
    return None


# ----------------------------------------------------------------------------------------------------
# The ablation's measures: of one run, then per arm x lr over seeds, then paired between arms

# The claims, fixed before any run: (claim, arm a, arm b, the per-seed measure of a - b that decides it)
CLAIMS = [("NVFP4 raises the policy's entropy before any update", "nvfp4", "bf16", "entropy0"),
          ("reward rises faster with NVFP4 than with bf16", "nvfp4", "bf16", "reward_auc"),
          ("AQN helps on top of NVFP4", "nvfp4_aqn", "nvfp4", "reward_auc"),
          ("noise alone helps: bf16 + AQN beats bf16", "bf16_aqn", "bf16", "reward_auc")]
PAIRS = [("nvfp4", "bf16"), ("nvfp4_aqn", "nvfp4"), ("bf16_aqn", "bf16"), ("nvfp4_aqn", "bf16"),
         ("nvfp4_aqn", "nvfp4_aqn_notis")]  # every pair is compared on every measure, at every lr
MEASURES = {"entropy0": "entropy before any update (probe)", "reward_auc": "mean reward over all steps",
            "acc_auc": "mean sampled accuracy over all steps", "final_acc": "final held-out greedy accuracy"}

WINDOW = 5  # steps in the trailing mean of sampled accuracy that the sampled threshold judges
RULE = ("Rule: each claim compares two arms on the same seeds (paired: same data order and sampling draws). It is "
        "**supported** if the 95% t-interval of the mean per-seed difference a - b lies above 0, **refuted** if it "
        "lies below 0, **inconclusive** if it holds 0 or fewer than 2 seeds are paired. The exact sign-flip p-value "
        "is shown beside it (with n seeds it cannot go below 2 / 2^n: 0.0625 at 5). Each claim's measure was fixed "
        "before any run: the entropy probe before any update for the first, the mean reward over all steps (the "
        "area under the reward curve) for the others.")


def _mean(xs) -> float:
    ok = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(ok) / len(ok) if ok else math.nan


def run_measures(steps: int, rows: list[dict], evals: dict, post: dict, thr_greedy: float, thr_sampled: float,
                 window: int = 5) -> dict:
    """One finished run's numbers. rows: train.py's metrics.jsonl (the rows with "reward" are training steps 0 ..
    steps-1, the rollout of step s made after s updates); evals: {step: greedy held-out accuracy}; post: the post-run
    evaluations ({} when missing). AUC = the mean over all steps (the area under the curve over its length)."""
    train = {r["step"]: r for r in rows if "reward" in r}  # a step logged twice (a resume) keeps its last row
    col = lambda k: [float(train.get(s, {}).get(k, math.nan)) for s in range(steps)]  # noqa: E731
    reward, acc, e_steps = col("reward"), col("accuracy"), sorted(evals)
    return dict(steps=steps, reward=reward, accuracy=acc, entropy=col("entropy"), evals=evals,
                entropy0=post.get("entropy_probe"), entropy0_noisy=post.get("entropy_probe_noisy"),
                entropy0_trainer=train.get(0, {}).get("entropy"), reward_auc=_mean(reward), acc_auc=_mean(acc),
                final_acc=evals.get(steps), mismatch=_mean(col("mismatch_abs")),
                tis_capped=_mean(col("tis_capped_frac")),
                steps_greedy=first_reach(e_steps, [evals[s] for s in e_steps], thr_greedy),
                steps_sampled=first_reach(list(range(steps)), acc, thr_sampled, window),
                pass_at_k=post.get("pass_at_k", {}), device=post.get("device"))


def aggregate(runs: dict, arms, lrs, seeds) -> dict:
    """Per arm x lr ("arm@lr"): each measure's mean with its t-interval over seeds, and the curves' bands.
    runs: (arm, lr, seed) -> dict(summary=run_measures(...) or None when unfinished, timing={gpu_seconds, ...})."""
    groups = {}
    for arm in arms:
        for lr in lrs:
            done = [s for s in seeds if runs[(arm, lr, s)]["summary"]]
            ss = [runs[(arm, lr, s)]["summary"] for s in done]
            g = dict(arm=arm, lr=lr, seeds=done,
                     gpu_minutes=sum(runs[(arm, lr, s)]["timing"].get("gpu_seconds", 0) for s in seeds) / 60)
            for k in ("entropy0", "entropy0_trainer", "entropy0_noisy", "reward_auc", "acc_auc", "final_acc",
                      "mismatch", "tis_capped"):
                g[k] = mean_ci([x[k] for x in ss])
            for k in ("steps_greedy", "steps_sampled"):  # seeds that never reach it have no step: count them apart
                hit = sorted(x[k] for x in ss if x[k] is not None)
                g[k] = dict(reached=len(hit), of=len(ss), median=hit[len(hit) // 2] if hit else None)
            final = [x["pass_at_k"].get(str(x["steps"]), {}) for x in ss]  # pass@k after the last step
            g["pass_at_k_final"] = {k: mean_ci([f.get(k) for f in final]) for k in sorted({k for f in final for k in f})
                                    if not k.endswith("ci95")}
            if ss:
                T = min(x["steps"] for x in ss)
                g["curves"] = {k: [list(map(float, c)) for c in band([x[k][:T] for x in ss])]
                               for k in ("reward", "accuracy", "entropy")}
                g["evals"] = {s: mean_ci([x["evals"][s] for x in ss])
                              for s in sorted(set.intersection(*[set(x["evals"]) for x in ss]))}
                at = sorted(set.intersection(*[set(map(int, x["pass_at_k"])) for x in ss]))  # steps every seed has
                g["pass_at_k"] = {s: {k: mean_ci([x["pass_at_k"][str(s)].get(k) for x in ss])
                                      for k in ss[0]["pass_at_k"][str(s)] if not k.endswith("ci95")} for s in at}
            groups[f"{arm}@{lr:g}"] = g
    return groups


def compare(runs: dict, arms, lrs, seeds) -> tuple[list, list]:
    """Paired comparisons a - b of every PAIRS pair x measure x lr, and the CLAIMS' verdicts."""
    value = lambda arm, lr, k: {s: runs[(arm, lr, s)]["summary"][k] for s in seeds  # noqa: E731
                                if runs[(arm, lr, s)]["summary"]}
    comps = [dict(a=a, b=b, lr=lr, measure=k, **paired(value(a, lr, k), value(b, lr, k)))
             for a, b in PAIRS if a in arms and b in arms for lr in lrs for k in MEASURES]
    verdicts = [dict(claim=text, a=a, b=b, lr=lr, measure=k, **paired(value(a, lr, k), value(b, lr, k)))
                for text, a, b, k in CLAIMS if a in arms and b in arms for lr in lrs]
    return comps, verdicts


# ----------------------------------------------------------------------------------------------------
# The report: results.md's tables and the figures

def ci_text(c: dict, digits: int = 3) -> str:
    if not c["n"]:
        return "-"
    return f"{c['mean']:.{digits}f}" + (f" [{c['lo']:.{digits}f}, {c['hi']:.{digits}f}]" if c["n"] > 1 else "")


def figure(groups: dict, labels: dict, lr: float) -> bytes:
    """One lr's PNG of every arm (labels: arm -> label): the training curves with bands, and the held-out
    evaluations (greedy accuracy, pass@1 and the largest pass@k) as markers with bars at the steps they were made."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gs = {arm: groups[f"{arm}@{lr:g}"] for arm in labels}
    k = max((int(k[5:]) for g in gs.values() for p in g.get("pass_at_k", {}).values() for k in p), default=1)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    panels = [("reward", "reward (training batch)"), ("accuracy", "sampled accuracy (training prompts)"),
              ("entropy", "entropy of the sampled tokens (nats)"), ("evals", "held-out greedy accuracy"),
              ("pass@1", "held-out pass@1 (sampled)"), (f"pass@{k}", f"held-out pass@{k}")]
    for ax, (key, title) in zip(axes.flat, panels):
        for i, (arm, label) in enumerate(labels.items()):
            g = gs[arm]
            if not g["seeds"]:
                continue
            kw = dict(color=f"C{i}", label=f"{label} (n={len(g['seeds'])})")
            if key in g["curves"]:
                mean, lo, hi = g["curves"][key]
                ax.plot(range(len(mean)), mean, linewidth=1.3, **kw)
                ax.fill_between(range(len(mean)), lo, hi, color=kw["color"], alpha=0.15, linewidth=0)
                continue
            # markers only: a line between two evaluations would suggest what was never measured
            pts = g["evals"] if key == "evals" else {s: p[key] for s, p in g["pass_at_k"].items() if key in p}
            xs = sorted(pts)
            m, lo, hi = ([pts[s][q] for s in xs] for q in ("mean", "lo", "hi"))
            err = [[y - a if math.isfinite(a) else 0 for y, a in zip(m, lo)],
                   [b - y if math.isfinite(b) else 0 for y, b in zip(m, hi)]]
            xs = [x + 0.012 * max(xs[-1] if xs else 1, 1) * (i - 2) for x in xs]  # the arms side by side
            ax.errorbar(xs, m, yerr=err, fmt="o", capsize=3, **kw)
        ax.set(title=title, xlabel="RL step (updates made)")
        ax.grid(alpha=0.3)
    if axes.flat[0].get_legend_handles_labels()[0]:  # no finished run yet: no legend
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"lr {lr:g}: mean over seeds; bands and bars: 95% t-interval")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


def markdown(res: dict) -> str:
    """results.md from results.json's content."""
    cfg, groups = res["config"], res["groups"]
    rc = next((r["config"] for r in res["runs"].values() if r.get("config")), {})
    p = lambda c: "-" if c["p"] is None else f"{c['p']:.4g}"  # noqa: E731
    L = ["# Does quantization noise help? The QeRL ablation", "",
         f"Model `{rc.get('model')}`, task `{rc.get('task')}`, {rc.get('algo')}, {rc.get('steps')} steps of "
         f"{rc.get('prompts_per_step')} prompts x {rc.get('group_size')} samples, {rc.get('eval_limit')} held-out "
         f"prompts; learning rates {', '.join(f'{x:g}' for x in cfg['lrs'])}; seeds {cfg['seeds']}; train.py flags "
         f"`{' '.join(cfg['train_flags']) or '(none)'}`; devices {', '.join(res['devices']) or '-'}. Finished runs: "
         f"{res['finished']} of {len(res['runs'])}.", "", "## Conclusions, as measured", "", RULE, "",
         "| claim | lr | a - b: measure | pairs | mean difference [95% CI] | sign-flip p | verdict |", "|---" * 7 + "|"]
    L += [f"| {c['claim']} | {c['lr']:g} | {c['a']} - {c['b']}: {MEASURES[c['measure']]} | {c['n']} | "
          f"{ci_text(c, 4)} | {p(c)} | **{c['verdict']}** |" for c in res["claims"]]
    L += [] if res["claims"] else ["| (no claim has both its arms in --arms) |" + " |" * 6]
    k = max((int(k[5:]) for g in groups.values() for k in g["pass_at_k_final"]), default=1)
    L += ["", "## Arms", "", "Mean over seeds [95% t-interval]. Entropy (nats a token): the probe (the policy's own "
          "samples on the held-out prompts, before any update), the trainer's at step 0 (training prompts), the probe "
          "at sigma_start (AQN arms). Steps to threshold: median over the seeds that reached it (reached / seeds); "
          f"greedy >= {cfg['threshold_greedy']} at the evaluation steps, sampled >= {cfg['threshold_sampled']} as a "
          f"trailing mean of {WINDOW} steps. pass@k: {cfg['pass_k_n']} samples a prompt at T = "
          f"{cfg['pass_temperature']} after the last step. Mismatch: mean |log p engine - log p trainer|. "
          f"{res['device_kind']}-min: wall time x device share.", "",
          "| arm | lr | seeds | entropy probe | trainer's | probe, noisy | mean reward | mean sampled acc | "
          f"final greedy acc | steps to greedy | steps to sampled | pass@1 | pass@{k} | mismatch | TIS capped | "
          f"{res['device_kind']}-min |", "|---" * 16 + "|"]
    for g in groups.values():
        pk, reach = g["pass_at_k_final"], [g[x] for x in ("steps_greedy", "steps_sampled")]
        L.append(" | ".join([f"| {res['arms'][g['arm']]['label']}", f"{g['lr']:g}", str(len(g["seeds"]))]
                            + [ci_text(g[x]) for x in ("entropy0", "entropy0_trainer", "entropy0_noisy",
                                                       "reward_auc", "acc_auc", "final_acc")]
                            + [f"{r['median']} ({r['reached']}/{r['of']})" if r["reached"] else f"- (0/{r['of']})"
                               for r in reach]
                            + [ci_text(pk[x]) if x in pk else "-" for x in ("pass@1", f"pass@{k}")]
                            + [ci_text(g["mismatch"], 5), ci_text(g["tis_capped"]), f"{g['gpu_minutes']:.1f} |"]))
    L += ["", "## Paired comparisons", "", "Mean per-seed difference a - b [95% t-interval], sign-flip p, and what "
          "the rule above says of it.", "", "| a - b | lr | measure | pairs | difference | p | verdict |",
          "|---" * 7 + "|"]
    L += [f"| {c['a']} - {c['b']} | {c['lr']:g} | {MEASURES[c['measure']]} | {c['n']} | {ci_text(c, 4)} | {p(c)} | "
          f"{c['verdict']} |" for c in res["comparisons"]]
    gm = res["gpu_minutes"]
    L += ["", "## Time", "", f"{res['device_kind']}-minutes per arm (wall time x device share, every attempt): "
          + ", ".join(f"{a} {m:.1f}" for a, m in gm["per_arm"].items()) + f"; in all **{gm['total']:.1f}**. Machine "
          f"time held (each invocation's wall time x its devices): {gm['held']:.1f} minutes.", "", "## Figures", ""]
    L += [f"![lr {lr:g}](fig_lr{lr:g}.png)" for lr in cfg["lrs"]]
    missing = [f"- {n}: {r['error'] or 'not run yet'}" for n, r in res["runs"].items() if not r.get("config")]
    return "\n".join(L + (["", "## Runs without results", ""] + missing if missing else [])) + "\n"


def clean(x):
    """JSON without NaN (not valid JSON): nan and inf become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    return [clean(v) for v in x] if isinstance(x, (list, tuple)) else x


if __name__ == "__main__":
    try:
        values = [float(x) for x in sys.argv[1:]]
    except ValueError:
        sys.exit("error: pass per-seed differences as numbers, e.g. python experiments/stats.py 0.1 -0.2 0.3")
    r = paired(dict(enumerate(values)), {i: 0.0 for i in range(len(values))})
    print(f"n {r['n']}: mean {r['mean']:.4g}, 95% t-interval [{r['lo']:.4g}, {r['hi']:.4g}], sign-flip p {r['p']:.4g}"
          f" (smallest possible {r['min_p']}): {r['verdict']}")
