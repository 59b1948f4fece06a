"""noise.py: adaptive quantization noise (AQN): a decaying Gaussian added to the RMSNorm weights.

    python noise.py --total-steps 100                     # print the sigma schedule, stage by stage

For the norm that feeds q/k/v (input_layernorm) and the one that feeds gate/up
(post_attention_layernorm) of every layer, a fresh z ~ N(0, sigma^2 I) of size hidden enters
layers/ops.rms_norm as `noise`: the norm uses weight + z, formed in fp32 (in bf16, w + z == w for
|w| in [0.5, 2] and sigma <= 7e-4), which is multiplicative noise (1 + z / w) on the next linear's
input channels at no GEMM cost. The stored weights are never touched (nothing accumulates across
steps).

The path of z, each hop an argument named `noise`: train.rl_step draws it (draw), passes it to
engine.generate, which passes it to Model.forward, whose Layer.forward hands z[layer] to the two
rms_norm calls. A forward without it is the clean policy.

Schedule. `stages` counts the equal intervals training is cut into, the noise-free one included, as
QeRL's code counts its num_stages and as the paper puts it ("10 evenly spaced intervals, initialized
with quantization noise, then from sigma_start to sigma_end"): stage 0 has sigma = 0 (the
quantization noise alone), and the K = stages - 1 noisy stages k = 1..K follow the paper's
exponential decay

    sigma(k) = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 1)),

so stage 1 runs at sigma_start and stage K at sigma_end exactly. stages = 10 (the paper's and the
README's): a noise-free tenth, then 9 noisy stages 1e-2, ..., 5e-4. One noisy stage (stages = 2)
runs at sigma_start. A run of fewer steps than stages is compressed, never skipped through: it uses
total_steps stages (one step each, still noise-free first and ending at sigma_end), and
schedule_note says so; a 1-step run has no noisy stage.

Where the noise applies is a flag: `rollout_only` (the default, as in the paper: the rollout
forward is noisy, the training forward is clean) or `both`. Leaves out: linear / cosine / log
decays (exponential worked best in the paper).
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import argparse
import json
import sys

import torch

WHERE = ("rollout_only", "both")


def _check(total_steps: int, stages: int, sigma_start: float = 1e-2, sigma_end: float = 5e-4):
    if total_steps < 1 or stages < 2:
        raise ValueError(f"need total_steps >= 1 and stages >= 2 (a noise-free stage, then noisy "
                         f"ones), got {total_steps} and {stages}")
    if not 0 < sigma_end <= sigma_start:
        raise ValueError(f"need 0 < sigma_end <= sigma_start (the noise decays), got sigma_end "
                         f"{sigma_end} and sigma_start {sigma_start}")


def stages_used(total_steps: int, stages: int) -> int:
    """The stages a run of total_steps really has: `stages`, or total_steps when fewer (each stage
    gets >= 1 step)."""
    _check(total_steps, stages)
    return min(stages, total_steps)


def stage_of(step: int, total_steps: int, stages: int = 10) -> int:
    """The 0-based stage of a 0-based step: S = stages_used equal intervals (sizes differ by at most
    one step); steps before 0 count as 0, steps past the end as the last one."""
    S = stages_used(total_steps, stages)
    # floor(step * S / T) cuts [0, T) into S intervals whose sizes differ by at most one step
    return min(S - 1, max(0, step) * S // total_steps)


def sigma_at(step: int, total_steps: int, sigma_start: float = 1e-2, sigma_end: float = 5e-4,
             stages: int = 10) -> float:
    """The AQN sigma at a 0-based training step: 0 in stage 0, then the paper's decay from
    sigma_start (stage 1) to sigma_end (the last stage). See the module docstring for what `stages`
    counts."""
    _check(total_steps, stages, sigma_start, sigma_end)
    k = stage_of(step, total_steps, stages)
    K = stages_used(total_steps, stages) - 1            # K noisy stages, numbered 1..K
    if k == 0:
        return 0.0                                      # stage 0: the quantization noise alone
    if sigma_start == sigma_end:
        return sigma_start
    t = (k - 1) / (K - 1) if K > 1 else 0.0            # one noisy stage: the first, sigma_start
    # sigma_start * (sigma_end / sigma_start) ** t, written so that t = 0 and t = 1 give the two
    # ends exactly
    return sigma_start ** (1 - t) * sigma_end ** t


def schedule(total_steps: int, sigma_start: float = 1e-2, sigma_end: float = 5e-4,
             stages: int = 10):
    """[(first step, last step, sigma)] per stage, stage 0 first."""
    S = stages_used(total_steps, stages)
    # ceil(k T / S): the first step where stage_of turns k; T closes the last stage
    firsts = [-(-k * total_steps // S) for k in range(S)] + [total_steps]
    rows = []
    for k in range(S):
        sigma = sigma_at(firsts[k], total_steps, sigma_start, sigma_end, stages)
        rows.append((firsts[k], firsts[k + 1] - 1, sigma))
    return rows


def schedule_note(total_steps: int, stages: int) -> str | None:
    """One line for the user when the schedule is not the one asked for (None when it is): a run of
    fewer steps than stages is compressed to one stage a step, and a single noisy stage runs at
    sigma_start (sigma_end not reached)."""
    S = stages_used(total_steps, stages)
    if S == 1:
        return (f"AQN: {total_steps} step is too few for {stages} stages: the run is the "
                f"noise-free stage alone (no AQN noise); train at least 2 steps for noise")
    if S == 2:                                          # one noisy stage, at sigma_start
        tail = ", which runs at sigma_start: sigma_end is not reached unless equal"
    else:
        tail = ", still from sigma_start to sigma_end"
    if S < stages:
        return (f"AQN: {total_steps} steps are fewer than the {stages} stages asked for: the "
                f"schedule is compressed to {S} stages of one step each (the noise-free one, then "
                f"{S - 1} noisy{tail})")
    if S == 2:
        return f"AQN: {stages} stages give one noisy stage{tail}"
    return None


def sample(num_layers: int, hidden: int, sigma: float, generator: torch.Generator,
           device="cpu") -> torch.Tensor:
    """(layers, 2, hidden) fp32: index 0 for the q/k/v norm, 1 for the gate/up norm; each its own
    draw."""
    # drawn on the CPU generator, then moved: the same seed gives the same noise on any device
    z = torch.randn(num_layers, 2, hidden, generator=generator, dtype=torch.float32)
    return (z * sigma).to(device)


def draw(model, sigma: float, generator: torch.Generator) -> torch.Tensor | None:
    """This step's noise for `model`: (layers, 2, hidden) fp32 on the model's device, or None when
    sigma is 0. The caller passes it on explicitly (engine.generate(noise=...), model(noise=...)):
    nothing is stored on the model, so a forward without it is the clean policy."""
    if sigma == 0:
        return None
    cfg = model.cfg
    device = model.model.norm.weight.device
    return sample(cfg.num_layers, cfg.hidden_size, sigma, generator, device)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Print the AQN sigma schedule: each stage's steps and sigma.")
    ap.add_argument("--total-steps", type=int, default=100, help="training steps")
    ap.add_argument("--sigma-start", type=float, default=1e-2,
                    help="sigma of stage 1, the first noisy stage")
    ap.add_argument("--sigma-end", type=float, default=5e-4, help="sigma of the last stage")
    ap.add_argument("--stages", type=int, default=10,
                    help="equal stages, the noise-free stage 0 included")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))

    try:
        rows = schedule(args.total_steps, args.sigma_start, args.sigma_end, args.stages)
    except ValueError as e:
        ap.error(str(e))
    for k, (first, last, sigma) in enumerate(rows):
        mark = "  (noise-free)" if k == 0 else ""
        print(f"stage {k:3d}  steps {first:6d} - {last:6d}  sigma {sigma:.3e}{mark}")

    note = schedule_note(args.total_steps, args.stages)
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
