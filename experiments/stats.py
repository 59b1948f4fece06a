"""stats.py: the statistics of the QeRL ablation (experiments/qerl_ablation.py): intervals over
seeds, the paired test and the verdict rule. numpy and the standard library only.

    python experiments/stats.py 0.12 0.30 -0.05 0.21 0.18    # a paired comparison of these diffs

- `t_ppf`: quantiles of Student's t, from its CDF through the regularized incomplete beta function
  (a continued fraction, Lentz's method) and bisection; no scipy needed.
- `mean_ci`: the mean over seeds with a 95% t-interval (mean +- t(0.975, n-1) * sd / sqrt(n));
  `band` the same per step for curves (seeds x steps).
- `sign_flip_p`: the paired permutation test. Under "no difference between the arms" each seed's
  difference is as likely to have either sign, so the p-value is the share of the 2^n sign patterns
  whose mean is at least as far from 0 as the observed one: exact up to 20 seeds, 2^20 seeded
  random patterns beyond. With n seeds it cannot go below 2 / 2^n (0.0625 at 5 seeds), which is why
  the verdicts rest on the interval, not on the p-value.
- `detectable`: the smallest true mean difference the paired t-test finds (its 95% interval
  clear of 0) with 80% probability at this spread and number of seeds: (t(0.975, n-1) +
  t(0.80, n-1)) * sd / sqrt(n), the usual normal-shift approximation of the noncentral t.
- `verdict`: "supported" when the 95% interval of the paired mean difference lies above 0,
  "refuted" when it lies below 0, "inconclusive" when it holds 0 (or there are fewer than 2 pairs).
The measures of the runs and the report are experiments/ablation_report.py's.
Leaves out: multiple-comparison corrections (the claims are few and fixed before the runs),
bootstrap intervals.
"""
import functools
import math
import sys

import numpy as np

# up to this many pairs the sign-flip test enumerates every pattern (2^20 = 1M rows of n signs)
EXACT_MAX = 20


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        for num in (even, odd):
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
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                 + b * math.log1p(-x))
    front = math.exp(log_front)
    # the fraction converges fast on this side; use the symmetry on the other
    if x < (a + 1.0) / (a + b + 2.0):
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
    """Per-step mean and t-interval over seeds: rows (seeds, steps), nan where a seed has no value
    -> mean, lo, hi, each (steps,). A step with one value has the value as its band; with none,
    nan."""
    y = np.asarray(rows, dtype=float)                                        # (S, T)
    ok = np.isfinite(y)
    n = ok.sum(0)                                                            # (T,) values a step
    mean = np.where(ok, y, 0.0).sum(0) / np.maximum(n, 1)                    # (T,)
    var = np.where(ok, (y - mean) ** 2, 0.0).sum(0) / np.maximum(n - 1, 1)  # (T,)
    t = np.array([_t975(k - 1, level) if k >= 2 else 0.0 for k in n])      # (T,)
    half = t * np.sqrt(var / np.maximum(n, 1))                               # (T,)
    mean = np.where(n > 0, mean, np.nan)
    return mean, mean - half, mean + half


@functools.lru_cache(maxsize=None)   # bands ask for the same few quantiles at every step
def _t975(df: int, level: float) -> float:
    return t_ppf(0.5 + level / 2.0, df)


def sign_flip_p(diffs, seed: int = 0) -> float:
    """Two-sided paired permutation (sign-flip) p-value of the mean difference (see the module
    docstring)."""
    d = np.asarray(diffs, dtype=float)                                       # (n,)
    n = len(d)
    if n == 0:
        return math.nan
    observed = abs(d.mean())
    if n <= EXACT_MAX:
        # (2^n, n): every pattern once
        bits = (np.arange(2 ** n)[:, None] >> np.arange(n)) & 1
        means = (1 - 2 * bits) @ d / n                                       # (2^n,)
        return float(np.mean(np.abs(means) >= observed - 1e-12))
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(2 ** 20, n))                       # (B, n)
    hits = np.sum(np.abs(signs @ d / n) >= observed - 1e-12)
    return float((1 + hits) / (1 + len(signs)))  # the observed pattern counts as one draw


def detectable(sd: float, n: int, power: float = 0.8, level: float = 0.95) -> float:
    """The smallest mean difference a paired comparison of n seeds with this spread of per-seed
    differences detects with probability `power` (two-sided, at `level`); nan below 2 seeds."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    return (t_ppf(0.5 + level / 2.0, n - 1) + t_ppf(power, n - 1)) * sd / math.sqrt(n)


def verdict(lo: float, hi: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    return "supported" if lo > 0 else "refuted" if hi < 0 else "inconclusive"


def paired(a: dict, b: dict) -> dict:
    """Compare arm a with arm b over the seeds both have ({seed: value}): the mean difference a - b
    with its 95% t-interval, the sign-flip p-value, its smallest possible value at this many pairs,
    the smallest difference this design detects (`detectable`) and the verdict."""
    def ok(v):
        return v is not None and math.isfinite(v)
    seeds = sorted(s for s in set(a) & set(b) if ok(a[s]) and ok(b[s]))
    diffs = [a[s] - b[s] for s in seeds]
    ci = mean_ci(diffs)
    min_p = 2.0 / 2 ** len(diffs) if 0 < len(diffs) <= EXACT_MAX else None
    return dict(seeds=seeds, diffs=diffs, n=ci["n"], mean=ci["mean"], lo=ci["lo"], hi=ci["hi"],
                p=sign_flip_p(diffs), min_p=min_p, detectable=detectable(ci["sd"], ci["n"]),
                verdict=verdict(ci["lo"], ci["hi"]))


def first_reach(steps, values, threshold: float, window: int = 1):
    """The first step whose trailing mean over `window` values reaches `threshold` (None: never).
    The first window - 1 steps have no full window and are not judged."""
    v = list(values)
    for i in range(window - 1, len(v)):
        if sum(v[i - window + 1:i + 1]) / window >= threshold:
            return steps[i]
    return None


if __name__ == "__main__":
    try:
        values = [float(x) for x in sys.argv[1:]]
    except ValueError:
        sys.exit("error: pass per-seed differences as numbers, e.g. "
                 "python experiments/stats.py 0.1 -0.2 0.3")
    r = paired(dict(enumerate(values)), {i: 0.0 for i in range(len(values))})
    print(f"n {r['n']}: mean {r['mean']:.4g}, 95% t-interval [{r['lo']:.4g}, {r['hi']:.4g}], "
          f"sign-flip p {r['p']:.4g} (smallest possible {r['min_p']}): {r['verdict']}")
