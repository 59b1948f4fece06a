"""lora.py's adapter files against peft (the real client): what load_adapter refuses, that a loaded
adapter's alpha and dropout are saved again, and that folder writes go through fsutil (temporary
beside the target). CPU, tiny models."""
import json
import tempfile
from pathlib import Path

import pytest
import torch

import lora
import model as M

IDS = torch.tensor([[3838, 374, 220, 17, 10, 18, 30, 151645, 198, 9707, 0, 11],
                    [40, 1079, 264, 1614, 315, 279, 1879, 13, 576, 4226, 374, 25]])
TARGETS = ("q_proj", "v_proj", "down_proj")


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ours_logits(m):
    with torch.no_grad():
        return m.logits(m.forward_padded(IDS, torch.ones_like(IDS, dtype=torch.bool)))


def randomize(params, seed=0):
    """Non-zero A and B (a fresh adapter has B = 0 and computes nothing, so any scale would
    pass)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture
def src(make_checkpoint):
    return make_checkpoint("qwen2", dtype=torch.float32)


def peft_adapter(src, folder, **config):
    """An adapter written by peft itself: LoraConfig(**config) on the transformers model, random A
    and B."""
    from peft import LoraConfig, get_peft_model
    pm = get_peft_model(hf_model(src), LoraConfig(**config))
    randomize([p for n, p in pm.named_parameters() if "lora_" in n])
    pm.save_pretrained(folder)
    return pm.eval()


def test_plain_peft_adapter_loads(src, tmp_path):
    """The check is no wall: a plain adapter as peft writes it (all of its LoraConfig fields) loads
    and matches."""
    pm = peft_adapter(src, tmp_path / "ad", r=4, lora_alpha=8, target_modules=list(TARGETS),
                      init_lora_weights="gaussian")
    m = M.Model.from_pretrained(src, dtype=torch.float32)
    lora.load_adapter(m, tmp_path / "ad")
    with torch.no_grad():
        assert (ours_logits(m) - pm(IDS).logits).abs().max() <= 1e-4


def test_peft_alpha_pattern_is_refused(src, tmp_path):
    # v_proj at alpha 32, the rest at 8: read as plain LoRA, every v_proj would run at a quarter of
    # its scale
    peft_adapter(src, tmp_path / "ad", r=4, lora_alpha=8, target_modules=list(TARGETS),
                 alpha_pattern={"v_proj": 32})
    assert (json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["alpha_pattern"]
            == {"v_proj": 32})
    m = M.Model.from_pretrained(src, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"alpha_pattern=\{\"v_proj\": 32\} \(per-module alphas\)"
                                         r".*merge_and_unload"):
        lora.load_adapter(m, tmp_path / "ad")
    # the model is untouched
    assert getattr(m, "lora_config", None) is None and not lora.lora_parameters(m)


# Each a PEFT LoraConfig field set to something lora.py does not implement (and, last, an option
# PEFT may add later).
REFUSED = [
    ("rank_pattern", {"q_proj": 8}),
    ("layers_to_transform", 0),          # layer 0 only: 0 is a setting, not "unset"
    ("layers_to_transform", [0]),
    ("modules_to_save", ["lm_head"]),
    ("bias", "lora_only"),
    ("bias", "all"),
    ("fan_in_fan_out", True),
    ("use_dora", True),
    ("use_rslora", True),
    ("lora_bias", True),
    ("exclude_modules", ["model.layers.0.self_attn.q_proj"]),
    ("target_parameters", ["mlp.experts.gate_up_proj"]),
    ("trainable_token_indices", [151645]),
    ("layer_replication", [[0, 2], [1, 2]]),
    ("alora_invocation_tokens", [151644]),
    ("use_qalora", True),
    # PiSSA moves the principal part of W out of the base weights
    ("init_lora_weights", "pissa"),
    ("init_lora_weights", "loftq"),
    ("target_modules", ".*\\.q_proj"),  # a string is a regex to PEFT
    ("peft_type", "LOHA"),
    ("kasa_config", {"beta": 1e-4}),
    ("some_future_option", True),
]


@pytest.mark.parametrize("field,value", REFUSED)
def test_options_beyond_plain_lora_are_refused(src, tmp_path, field, value):
    m = M.Model.from_pretrained(src, dtype=torch.float32)
    lora.add_lora(m, rank=4, alpha=8, targets=TARGETS)
    lora.save_adapter(m, tmp_path / "ad")
    cfg_file = tmp_path / "ad" / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=f"sets {field}=.*does not implement"):
        lora.load_adapter(M.Model.from_pretrained(src, dtype=torch.float32), tmp_path / "ad")


def test_loaded_alpha_and_dropout_are_saved_again(src, tmp_path):
    """Load an alpha-32 adapter into a model whose LoRA has alpha 16 (as train.py --resume does),
    save it again: peft must read back the adapter that our model computes."""
    from peft import PeftModel
    donor = M.Model.from_pretrained(src, dtype=torch.float32)
    randomize(lora.add_lora(donor, rank=4, alpha=32, dropout=0.1, targets=TARGETS))
    lora.save_adapter(donor, tmp_path / "alpha32")
    m = M.Model.from_pretrained(src, dtype=torch.float32)
    params = lora.add_lora(m, rank=4, alpha=16, targets=TARGETS)
    lora.load_adapter(m, tmp_path / "alpha32")
    # loaded in place: an optimizer keeps them
    assert all(p is q for p, q in zip(params, lora.lora_parameters(m)))
    ours = ours_logits(m)
    assert torch.equal(ours, ours_logits(donor))
    lora.save_adapter(m, tmp_path / "resaved")
    pm = PeftModel.from_pretrained(hf_model(src), tmp_path / "resaved").eval()
    with torch.no_grad():
        # 0.52 before: the re-save wrote alpha 16
        assert (pm(IDS).logits - ours).abs().max() <= 1e-4
    cfg = json.loads((tmp_path / "resaved" / "adapter_config.json").read_text())
    assert cfg["lora_alpha"] == 32 and cfg["lora_dropout"] == 0.1
    assert m.lora_config["lora_alpha"] == 32 and m.lora_config["lora_dropout"] == 0.1
    assert {lin.lora_dropout for _, lin in m.linears() if lin.lora_A is not None} == {0.1}

def test_folder_writes_make_their_temporary_beside_the_target(
        make_checkpoint, tmp_path, monkeypatch):
    """export_merged into a folder whose parent does not exist yet: the temporary goes beside the
    target (fsutil), not in $TMPDIR (another filesystem for a tmpfs /tmp, where the final rename
    fails); nothing is left behind."""
    src = make_checkpoint("qwen2")
    m = M.Model.from_pretrained(src)
    randomize(lora.add_lora(m, rank=4, alpha=8, targets=TARGETS))
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp",
                        lambda *a, **k: made.append(k.get("dir")) or mkdtemp(*a, **k))
    out = tmp_path / "exports" / "merged"
    lora.export_merged(m, src, out)
    lora.save_adapter(m, tmp_path / "exports" / "adapter")
    lora.save_adapter(m, tmp_path / "exports" / "adapter")   # over an existing adapter: replaced
    assert made and all(d is not None and Path(d) == out.parent for d in made)
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter", "merged"]
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
