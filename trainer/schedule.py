"""schedule.py: the learning-rate schedule of both trainers (ppo.py for RL, pretrain.py), and the
one place where an optimizer's learning rate is set.

    python train.py --lr 1e-5 --lr-schedule cosine --warmup-steps 10     # RL (ppo.ppo_update)
    python pretrain.py --preset cpu --out DIR                            # pretraining (lr_at)

Leaves out: restarts, step decay, per-group learning rates.
"""
import math


def lr_factor(i: int, total: int, warmup: int, schedule: str, floor: float = 0.0,
              warmup_from: int = 0) -> float:
    """Multiplier of the peak learning rate at optimizer step i of `total` (0-based).

    Warm-up (i + warmup_from) / warmup, then constant 1, or a decay over the remaining steps from 1
    to `floor`: linear (1 - progress) or cosine 0.5 * (1 + cos(pi * progress)). With floor 0 and
    warmup_from 0 this is transformers' get_*_schedule_with_warmup, which TRL uses (train.py);
    pretrain.py decays to 10% and counts its first step as warm-up step 1 (warmup_from 1)."""
    if i < warmup:
        return (i + warmup_from) / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (i - warmup) / max(1, total - warmup))
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape


def set_lr(opt_, lr: float) -> None:
    """The learning rate of the next optimizer step: the only place it is set."""
    for group in opt_.param_groups:
        group["lr"] = lr
