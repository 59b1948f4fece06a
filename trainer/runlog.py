"""runlog.py: train.py's metrics: one JSON line a step in run/metrics.jsonl, optional tensorboard /
W&B, and curves.png.

    python train.py --plot runs/dapo-20261122-120000      # redraw curves.png from metrics.jsonl

Which step is which, said once for every place that shows one: step s of the policy is the
policy after s updates. A training row's `step` s is the rollout sampled from it (steps 0 ..
steps-1), drawn at x = s. An evaluation at step s measures it too: its samples are in
eval/step_<s>, its row holds `eval_step` s, and its marker is drawn at x = s. So the baseline is
step 0 (its own row, before any update), an evaluation after the update of training step s sits in
that step's row with eval_step s + 1, and the last one is step `steps` (its own row).

Every training step appends one row (reward, accuracy, format rate, entropy, mismatch, importance
weights, sigma, timings, ...); an evaluation adds `eval_accuracy` (greedy, held-out prompts) and
`eval_step`. Two accuracies are never mixed up: `accuracy` is the training batch's sampled accuracy
(temperature 1, training prompts), `eval_accuracy` the greedy one on held-out prompts. The curves
draw training metrics as lines and evaluations as markers only: two evaluations joined by a line
would suggest a steady rise that was never measured.
Leaves out: smoothing, and comparing several runs in one figure (the experiment scripts do that).
"""
import json
from pathlib import Path

# (title, y label, [(metric key, legend label, drawn as "line" or "marker")])
PANELS = [
    ("Reward", "mean reward of the batch",
     [("reward", "shaped reward (training samples)", "line")]),
    ("Accuracy", "fraction correct",
     [("accuracy", "training, sampled (T = 1)", "line"),
      ("eval_accuracy", "held-out, greedy", "marker")]),
    ("Answer format", "fraction of samples",
     [("format_rate", "well-formed answer", "line"),
      ("parse_fail", "no answer found", "line")]),
    ("Policy entropy", "nats per token",
     [("entropy", "sampled tokens", "line")]),
    ("Response length", "tokens",
     [("resp_len", "mean completion length", "line")]),
    ("Engine vs trainer", "nats per token",
     [("mismatch_abs", "|log p engine - log p trainer|", "line"),
      ("kl_ref", "KL to the base policy", "line")]),
    ("Importance weights", "pi_trainer / pi_engine",
     [("tis_weight_mean", "mean (after the cap)", "line"),
      ("tis_weight_max", "max (after the cap)", "line"),
      ("tis_capped_frac", "fraction capped", "line")]),
    ("AQN noise", "sigma",
     [("sigma", "sigma of the norm noise", "line")]),
]


def read(run: Path) -> list[dict]:
    """The rows of run/metrics.jsonl; a last line cut by a kill (log's one short write) is left
    out, so that the folder can still be resumed or plotted."""
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    rows = [json.loads(x) for x in lines[:-1]]
    try:
        rows += [json.loads(x) for x in lines[-1:]]
    except json.JSONDecodeError:
        pass                                               # the partial last line of a kill
    return rows


def truncate(run: Path, start: int) -> None:
    """Keep only the rows of steps before `start` (a resume replays the steps after its
    checkpoint)."""
    from util import fsutil

    rows = [r for r in read(run) if r.get("step", 0) < start]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    fsutil.atomic_write_text(Path(run) / "metrics.jsonl", text)


def writers(cfg: dict, run: Path) -> list:
    """The optional extra loggers the config asks for, as (kind, writer) pairs."""
    out = []
    if cfg.get("tensorboard"):
        from torch.utils.tensorboard import SummaryWriter
        out.append(("tb", SummaryWriter(str(Path(run) / "tb"))))
    if cfg.get("wandb"):
        import wandb
        out.append(("wandb", wandb.init(project="nanoqerl", config=cfg, dir=str(run))))
    return out


def log(run: Path, row: dict, extra_writers=()) -> None:
    """Append one row to metrics.jsonl (one short write: a kill leaves at worst a last partial
    line) and mirror it."""
    with open(Path(run) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    for kind, w in extra_writers:
        for k, v in row.items():
            if not isinstance(v, (int, float)) or k in ("step", "eval_step"):
                continue
            if kind == "tb":
                w.add_scalar(k, v, row["step"])
            else:
                w.log({k: v}, step=row["step"])


def x_of(row: dict, style: str) -> int:
    """Where a row's metric is drawn (the module docstring): a training metric at its step, an
    evaluation at its eval_step (the rows of runs older than eval_step: their step, plus one in a
    training step's row, whose evaluation followed its update)."""
    if style == "marker":
        return row.get("eval_step", row["step"] + ("reward" in row))
    return row["step"]


def first_eval(run: Path) -> float | None:
    return next((r["eval_accuracy"] for r in read(run) if "eval_accuracy" in r), None)


def plot(run: Path) -> Path:
    """Draw curves.png for a run folder: one panel per group of PANELS that has data."""
    import matplotlib
    matplotlib.use("Agg")                   # no display needed
    import matplotlib.pyplot as plt

    run = Path(run)
    rows = read(run)
    panels = [p for p in PANELS if any(key in r for key, _, _ in p[2] for r in rows)]
    cols = 4
    nrows = max(1, (len(panels) + cols - 1) // cols)                  # ceil(panels / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:     # the unused cells of the last row
        ax.axis("off")
    for ax, (title, ylabel, keys) in zip(axes.flat, panels):
        for key, label, style in keys:
            pts = [(x_of(r, style), r[key]) for r in rows if key in r]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if style == "marker":
                ax.plot(xs, ys, "o", markersize=6, label=label)
            else:
                ax.plot(xs, ys, "-", linewidth=1.2, label=label)
        ax.set_title(title)
        ax.set_xlabel("RL step s (the policy after s updates)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{run.name}", fontsize=12)
    fig.tight_layout()
    out = run / "curves.png"
    # beside its target, then renamed over it; savefig picks the format from the suffix
    tmp = run / ".curves.png.tmp-plot.png"
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(out)
    return out
