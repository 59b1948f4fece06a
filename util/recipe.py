"""recipe.py: the RL defaults a model folder carries: the "rl" key of the recipe.json that
pretrain.py writes (its task, answer format, length limit, learning rate, LoRA size, ...), which
train.py and eval.py take for the flags left out, wherever the folder lies.

    python train.py --algo dapo --model models/countdown5     # its own task and settings

Leaves out: recipes of models not made by pretrain.py (real models keep train.py's defaults).
"""
import json
from pathlib import Path

# The RL defaults a model folder may carry: recipe.json's "rl" key (pretrain.py writes it), each
# with the types it may take. task and eval_task are None where no registered task matches the
# generator knobs the model was trained on.
RL_KEYS = {"task": (str, type(None)), "eval_task": (str, type(None)), "fmt": (str,),
           "steps": (int,), "max_new_tokens": (int,), "lr": (int, float), "lora_rank": (int,),
           "lora_alpha": (int, float), "format_weight": (int, float), "eval_every": (int,),
           "grad_checkpoint": (bool,)}


def rl_defaults(folder) -> dict | None:
    """The RL defaults of a local model folder: the "rl" key of its recipe.json, or None when it
    has none (a real model, a hub id, a folder made before recipes carried them). A key that is
    missing, unknown or of the wrong type is a ValueError naming it."""
    path = Path(folder) / "recipe.json"
    if not path.is_file():
        return None
    try:
        recipe = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read ({e}): fix it, or pass every flag") from None
    rl = recipe.get("rl") if isinstance(recipe, dict) else None
    if rl is None:
        return None
    keys = set(rl) if isinstance(rl, dict) else set()
    if keys != set(RL_KEYS):
        missing, extra = sorted(set(RL_KEYS) - keys), sorted(keys - set(RL_KEYS))
        raise ValueError(f"{path}: its \"rl\" key must hold exactly {', '.join(RL_KEYS)} "
                            f"(missing: {missing or 'none'}; unknown: {extra or 'none'})")
    for name, kinds in RL_KEYS.items():
        # bool is an int in Python: a true/false where a number belongs is refused too
        wrong_bool = isinstance(rl[name], bool) and bool not in kinds
        if wrong_bool or not isinstance(rl[name], kinds):
            raise ValueError(f"{path}: \"rl\" {name} = {rl[name]!r} has the wrong type")
    return rl
