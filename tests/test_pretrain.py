"""pretrain.py, tasks/arith.py and the shipped models/arith-cpu: the task and its split, the
tokenizer, a short run that learns, the shipped checkpoint in every client (transformers, model.py,
quantize.py + compressed-tensors, peft), its sha256 and accuracy band, and bad input. On CPU."""
import hashlib
import json
import random
from pathlib import Path

import pytest
import torch

from tasks import arith
from tasks import data
from tasks import tokenizer
import pretrain

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "arith-cpu"
SHIPPED_SHA256 = "df7fd512a5134e29eb092a8b44834292f02397bfa25f25aa87f4bc9b830e13dd"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(SHIPPED)


# --------------------------------------------------------------------------------------------------
# The task

def test_split_is_a_hash_of_the_unordered_pair():
    for a, b in [(4738, 2591), (1000, 9999), (12, 7)]:
        lo, hi = sorted((a, b))
        # the rule, written out independently
        h = int(hashlib.sha256(f"{lo}+{hi}".encode()).hexdigest()[:16], 16)
        assert arith.split_of(a, b) == arith.split_of(b, a) == ("test" if h % 100 < 10 else "train")


def test_train_and_test_rows_never_overlap():
    train = {frozenset((r["a"], r["b"])) for seed in (0, 1)
             for r in arith.rows(5000, seed, "train")}
    test = {frozenset((r["a"], r["b"])) for r in arith.rows(3000, 123, "test")}
    assert len(train) > 9000 and len(test) > 2000
    assert not train & test
    # what train.py reads through data.load_rows: the registered tasks, by question text
    tr, _ = data.load_rows("arith", seed=0)
    te, _ = data.load_rows("arith_test", seed=0)
    assert tr[0]["kind"] == te[0]["kind"] == "gsm8k"
    assert not {r["question"] for r in tr} & {r["question"] for r in te}


def test_test_rows_do_not_depend_on_the_seed():
    assert ([r["question"] for r in arith.rows(20, 0, "test")]
            == [r["question"] for r in arith.rows(20, 7, "test")])


@pytest.mark.parametrize("a, b, slip, text, value", [
    # worked by hand: 8+1=9; 3+9=12; 7+5+1=13; 4+2+1=7
    (4738, 2591, 0.0, "8+1=9 9\n3+9=12 29\n7+5+1=13 329\n4+2+1=7 7329\n\\boxed{7329}", 7329),
    # every owed carry forgotten: 8+1=9; 3+9=12; 7+5=12; 4+2=6
    (4738, 2591, 1.0, "8+1=9 9\n3+9=12 29\n7+5=12 229\n4+2=6 6229\n\\boxed{6229}", 6229),
    # the last column writes its whole sum
    (95, 87, 0.0, "5+7=12 2\n9+8+1=18 182\n\\boxed{182}", 182),
])
def test_worked_solutions(a, b, slip, text, value):
    assert arith.solution(a, b, random.Random(0), slip) == (text, value)


@pytest.mark.parametrize("response, correct, formatted", [
    ("1+2=3 3\n\\boxed{7329}", True, True),
    ("\\boxed{7329", False, False),             # unclosed: no credit, not formatted
    ("the answer is 7329", False, False),       # no box: no credit
    ("\\boxed{73290}", False, True),
    ("\\boxed{1}\n\\boxed{7329}", True, True),  # the last closed box counts
])
def test_strict_checker(response, correct, formatted):
    assert arith.check(response, "7329") == (correct, formatted)


# --------------------------------------------------------------------------------------------------
# The shipped model

def test_shipped_sha256_and_recipe():
    recipe = json.loads((SHIPPED / "recipe.json").read_text())
    got = hashlib.sha256((SHIPPED / "model.safetensors").read_bytes()).hexdigest()
    assert got == SHIPPED_SHA256
    for name, digest in recipe["sha256"].items():
        assert hashlib.sha256((SHIPPED / name).read_bytes()).hexdigest() == digest, name
    assert sum(p.stat().st_size for p in SHIPPED.iterdir()) <= 5 * 2**20
    assert recipe["command"].startswith("python pretrain.py --preset cpu") and recipe["seed"] == 0
    m = recipe["metrics"]
    # the headroom band
    assert 0.2 <= m["sampled_accuracy"] <= 0.5 and m["sampled_format_rate"] >= 0.9, m


def test_shipped_tokenizer_chat_template_and_stops(tok):
    # our tokenizer.json as saved, not a rebuilt byte-level one
    assert type(tok).__name__ == "TokenizersBackend"
    ids = data.prompt_token_ids(tok, "What is 4738+2591?")
    assert tok.decode(ids) == tokenizer.chat_text("What is 4738+2591?")
    assert tok.convert_ids_to_tokens(ids[-3:]) == ["<|im_start|>", "assistant", "\n"]
    # a digit is a token
    assert [t for t in tok.convert_ids_to_tokens(ids) if t.isdigit()] == list("47382591")
    gen = json.loads((SHIPPED / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.convert_tokens_to_ids("<|endoftext|>") in gen["eos_token_id"]


def test_unencodable_character_is_a_clear_error(tok):
    with pytest.raises(Exception, match="outside this tokenizer's alphabet"):
        data.prompt_token_ids(tok, "What is 4738 × 2591?")
    with pytest.raises(ValueError, match="cannot encode: '×'"):
        tokenizer.encode_checked(tok, ["What is 4738 × 2591?"])


def test_shipped_logits_match_model_py(tok):
    from transformers import AutoModelForCausalLM

    import model as M
    ids = torch.tensor([data.prompt_token_ids(tok, "What is 4738+2591?")
                        + tok("8+1=9 9\n")["input_ids"]])
    ref = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()(ids).logits
    ours = M.Model.from_pretrained(str(SHIPPED), dtype=torch.float32)
    with torch.no_grad():
        got = ours.logits(ours.forward_padded(ids, torch.ones_like(ids, dtype=torch.bool)))
    assert (got - ref).abs().max().item() <= 1e-4


def test_shipped_quantizes_and_loads_in_compressed_tensors(tmp_path, tok):
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    import quantize as Q
    out = tmp_path / "arith-cpu-nvfp4"
    Q.quantize_checkpoint(str(SHIPPED), str(out), progress=False)
    config = json.loads((out / "config.json").read_text())
    # every linear is a multiple of 16: all quantized
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    sd = load_file(out / "model.safetensors")
    scheme = QuantizationScheme(**config["quantization_config"]["config_groups"]["group_0"])
    prefixes = sorted({k[:-len(".weight_packed")] for k in sd if k.endswith(".weight_packed")})
    assert len(prefixes) == 7 * config["num_hidden_layers"]
    for p in prefixes:
        parts = {k: sd[f"{p}.{k}"]
                 for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(parts, scheme)["weight"]
        assert torch.equal(theirs, Q.dequantize_weight(*parts.values(), dtype=theirs.dtype)), p
    deq = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    ids = torch.tensor([data.prompt_token_ids(tok, "What is 4738+2591?")])
    with torch.no_grad():
        assert torch.isfinite(deq(ids).logits).all()


def test_shipped_adapter_loads_in_peft(tmp_path, tok):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import lora
    import model as M
    ours = M.Model.from_pretrained(str(SHIPPED), dtype=torch.float32)
    lora.add_lora(ours, rank=4, alpha=8, seed=0)
    with torch.no_grad():
        for p in lora.lora_parameters(ours):
            p.normal_(0, 0.05)  # a non-zero adapter, so that loading it changes the logits
    lora.save_adapter(ours, tmp_path / "adapter", base_model=str(SHIPPED))
    hf = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32)
    peft_m = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.tensor([data.prompt_token_ids(tok, "What is 4738+2591?")])
    with torch.no_grad():
        got = ours.logits(ours.forward_padded(ids, torch.ones_like(ids, dtype=torch.bool)))
        assert (got - peft_m(ids).logits).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------------------------------
# pretrain.py runs

# two-digit sums, no slips, a 0.3M-parameter model: learns the procedure in about 300 steps (~40 s
# of one core)
TINY = ["--hidden-size", "128", "--intermediate-size", "256", "--num-layers", "2",
        "--num-heads", "4", "--num-kv-heads", "2", "--digits", "2", "--slip", "0",
        "--batch-size", "32", "--lr", "5e-3", "--warmup-steps", "20", "--eval-prompts", "32",
        "--final-prompts", "32", "--max-new-tokens", "32", "--threads", "1", "--qat-from", "0.9",
        "--device", "cpu"]


def test_pretrain_learns(tmp_path):
    out = tmp_path / "tiny"
    # evals: 0, end
    assert pretrain.main(TINY + ["--out", str(out), "--steps", "300", "--eval-every", "1000"]) == 0
    recipe = json.loads((out / "recipe.json").read_text())
    first, m = recipe["history"][0], recipe["metrics"]
    # about ln(vocab) at init
    assert first["step"] == 0 and first["greedy"] == 0.0 and first["heldout_loss"] > 4.0
    assert m["heldout_loss"] < 0.1 * first["heldout_loss"]
    assert m["greedy_accuracy"] >= 0.25 and m["nvfp4_greedy_accuracy"] >= 0.25, m
    assert ({"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"}
            <= set(recipe["sha256"]))


@pytest.mark.parametrize("args, msg", [
    (["--preset", "huge"], "unknown preset 'huge'; choose one of: cpu, gpu, countdown, stargraph"),
    (["--preset", "cpu"], "--out is required"),
    (["--hidden-size", "100"], "must be a multiple of 16"),
    (["--num-heads", "8"], "must be a whole head size"),
    (["--slip", "1.5"], "--slip is a probability"),
])
def test_bad_input(tmp_path, capsys, args, msg):
    out = [] if "--preset" in args and args[1] == "cpu" else ["--out", str(tmp_path / "x")]
    assert pretrain.main(args + out) == 2
    assert msg in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written, not even a temporary


def test_gpu_preset_runs_at_a_tiny_scale(tmp_path):
    """The gpu preset's model (>= 20M parameters) builds and trains; only the step count and batch
    are cut here."""
    out = tmp_path / "gpu"
    assert pretrain.main(["--preset", "gpu", "--out", str(out), "--steps", "2", "--batch-size", "4",
                          "--eval-every", "0", "--final-prompts", "2", "--max-new-tokens", "4",
                          "--threads", "1"]) == 0
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["metrics"]["parameters"] >= 20_000_000 and recipe["config"]["hidden_size"] == 512
    config = json.loads((out / "config.json").read_text())
    assert config["head_dim"] in pretrain.HEAD_DIMS and config["intermediate_size"] % 16 == 0


def test_existing_output_folder_is_refused_and_untouched(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert pretrain.main(["--out", str(out), "--steps", "1"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert ([p.name for p in tmp_path.iterdir()] == ["model"]
            and (out / "keep.txt").read_text() == "mine")


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(pretrain, "sha256_file", boom)  # dies while the folder is being written
    with pytest.raises(KeyboardInterrupt):
        pretrain.main(TINY + ["--out", str(tmp_path / "m"), "--steps", "1", "--eval-every", "0",
                              "--final-prompts", "2"])
    assert not any(tmp_path.iterdir())


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        pretrain.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for f in pretrain.dataclasses.fields(pretrain.Config):
        assert "--" + f.name.replace("_", "-") in text
    # preset-driven flags name the presets' values
    assert "[cpu: 1200, gpu: 3000, countdown: 4000, stargraph: 4000]" in " ".join(text.split())
