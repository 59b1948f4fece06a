"""checkpoint.py: train.py's checkpoints: write them atomically, find the last good one, load it
safely.

    run/checkpoints/step_000020/adapter/     the LoRA adapter in PEFT's format (peft, eval.py)
    run/checkpoints/step_000020/state.pt     step, AdamW state, RNG states: tensors, plain types
    run/checkpoints/step_000020/config.json  the run's flat config (the same as run/config.json)
    run/checkpoints/latest                   the name of the newest complete checkpoint

A checkpoint folder is filled beside its final name and renamed into place (fsutil.atomic_dir),
then `latest` is replaced, so a kill at any moment leaves either the old or the new checkpoint,
and at worst a hidden temporary that `clean_stale` removes on the next resume. Every checkpoint is
good by construction: `save` refuses an adapter with a NaN or inf, and train.py stops before an
optimizer step whose gradient is not finite.

state.pt loads with `torch.load(weights_only=True)`: a run folder from someone else cannot run
code when it is resumed. A state file that needs more than tensors and plain types is refused.
A state.pt or adapter file that cannot be read (cut short by a full disk or a bad copy) is a
CheckpointError naming it and the checkpoint to delete; once it is deleted, `latest` falls back
to the newest complete checkpoint left, so the advice holds.
Leaves out: keeping only the last N checkpoints (delete old step_* folders by hand).
"""
import json
import pickle
import random
from pathlib import Path

import torch

from util import fsutil
import lora


class CheckpointError(Exception):
    """A checkpoint that cannot be used, reported as one line by train.py."""


def folder(run: Path) -> Path:
    return Path(run) / "checkpoints"


def save(run: Path, step: int, model, optimizer, config: dict, base_model: str) -> Path:
    """Write checkpoints/step_<step> atomically and point `latest` at it. Returns its folder."""
    state = lora.adapter_state(model)
    if not all(torch.isfinite(t).all() for t in state.values()):
        raise FloatingPointError(f"the LoRA weights hold NaN or inf at step {step}: not saving "
                                 "them")
    target = folder(run) / f"step_{step:06d}"
    with fsutil.atomic_dir(target, replace=True) as tmp:
        lora.save_adapter(model, tmp / "adapter", base_model=base_model)
        # python's state is (int, tuple of ints, None): plain types, so weights_only loads it
        rng = dict(torch=torch.get_rng_state(), python=random.getstate())
        resume_state = dict(step=step, optimizer=optimizer.state_dict(), rng=rng)
        torch.save(resume_state, tmp / "state.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    fsutil.atomic_write_text(folder(run) / "latest", target.name)
    return target


def complete(run: Path) -> list[Path]:
    """The run's complete checkpoint folders (a state.pt and an adapter), oldest first."""
    cks = [p for p in folder(run).glob("step_*") if p.name[5:].isdigit()]
    return sorted((p for p in cks if (p / "state.pt").exists() and (p / "adapter").is_dir()),
                  key=lambda p: int(p.name[5:]))


def latest(run: Path) -> Path | None:
    """The checkpoint `latest` names, or, when that folder is gone (deleted by hand after a
    CheckpointError), the newest complete one left; None when the run has none."""
    pointer = folder(run) / "latest"
    if pointer.exists():
        ck = folder(run) / pointer.read_text().strip()
        if (ck / "state.pt").exists():
            return ck
    left = complete(run)
    return left[-1] if left else None


def fallback(run: Path, ck: Path) -> str:
    """What deleting checkpoint `ck` leads to, for the advice of a CheckpointError."""
    before = [p for p in complete(run) if int(p.name[5:]) < int(ck.name[5:])]
    if before:
        return f"delete {ck} to resume from the checkpoint before it, {before[-1].name}"
    return f"delete {ck}, the run's first checkpoint, to start the run again from step 0"


def load(run: Path, model, optimizer) -> int:
    """Load the latest checkpoint's adapter, optimizer and RNG states into place. Returns its step
    (0: none)."""
    ck = latest(run)
    if ck is None:
        return 0
    try:
        state = torch.load(ck / "state.pt", weights_only=True)
    except pickle.UnpicklingError as e:                 # weights_only met a class it will not build
        first = str(e).splitlines()[0]
        raise CheckpointError(f"{ck / 'state.pt'} holds objects other than tensors and plain "
                              f"types, and loading it could run code: refusing it ({first})"
                              ) from None
    except (RuntimeError, EOFError, OSError) as e:      # truncated or corrupt
        raise CheckpointError(f"{ck / 'state.pt'} cannot be read ({type(e).__name__}: {e}); "
                              f"{fallback(run, ck)}") from None
    try:
        lora.load_adapter(model, ck / "adapter")
    except lora.AdapterFileError as e:                  # cut short or overwritten
        raise CheckpointError(f"{e.path} is truncated or not a safetensors file ({e.detail}); "
                              f"{fallback(run, ck)}") from None
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    version, words, gauss = state["rng"]["python"]
    random.setstate((version, tuple(words), gauss))  # lists come back where tuples went in
    return int(state["step"])


def clean_stale(run: Path) -> list[Path]:
    """Remove the temporaries a killed checkpoint write left (hidden .step_* folders, a
    half-written `latest`)."""
    return fsutil.clean_stale(folder(run))


def where(run: Path, save_every: int) -> str:
    """One phrase for a stop message: the last good checkpoint and the resume command, or that
    there is none."""
    ck = latest(run)
    if ck is None:
        return f"no checkpoint was written yet (one every --save-every {save_every} steps)"
    return f"the last good checkpoint is {ck}; continue with: python train.py --resume {run}"
