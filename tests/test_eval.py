"""eval.py: pass@k, an end-to-end evaluation of tiny models (bf16, NVFP4 + adapter) on GSM8K rows,
and bad input."""
import json
import shutil

import pytest
import torch

import eval as E
import lora
import model as M
import quantize as Q
import rollout


def test_pass_at_k_unbiased_estimator():
    assert E.pass_at_k(4, 1, 1) == 0.25
    assert E.pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)      # 1 - C(3,2)/C(4,2)
    assert E.pass_at_k(8, 3, 4) == pytest.approx(1 - 5 / 70)     # 1 - C(5,4)/C(8,4)
    assert E.pass_at_k(4, 0, 4) == 0.0 and E.pass_at_k(4, 4, 1) == 1.0


def test_eval_end_to_end_bf16(make_checkpoint, tmp_path, capsys):
    out = tmp_path / "ev"
    rc = E.main(["--model", str(make_checkpoint("qwen2")), "--task", "gsm8k", "--limit", "3",
                 "--n", "2", "--temperature", "1.0", "--max-new-tokens", "6", "--out", str(out)])
    assert rc == 0
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert (len(lines) == 6
            and {"question", "gold", "response", "pred", "correct", "parse_failed", "length"}
            <= set(lines[0]))
    assert lines[0]["gold"] == "18"  # the first GSM8K test row (Janet's ducks)
    s = json.loads((out / "summary.json").read_text())
    assert (s["prompts"] == 3 and s["samples_per_prompt"] == 2 and "pass@2" in s
            and 0 <= s["pass@1"] <= 1)
    assert (s["mean_length"] <= 6
            and s["parse_fail_rate"] == sum(x["parse_failed"] for x in lines) / 6)
    assert "gsm8k: pass@1" in capsys.readouterr().out


def test_eval_nvfp4_with_adapter(make_checkpoint, tmp_path):
    src = make_checkpoint("qwen3")
    Q.quantize_checkpoint(str(src), str(tmp_path / "q"), progress=False)
    m = M.Model.from_pretrained(tmp_path / "q")
    lora.add_lora(m, rank=4, alpha=8)
    with torch.no_grad():
        for p in lora.lora_parameters(m):
            p.normal_(0, 0.05)
    lora.save_adapter(m, tmp_path / "ad")
    assert E.main(["--model", str(tmp_path / "q"), "--adapter", str(tmp_path / "ad"),
                   "--task", "synthetic", "--limit", "4", "--max-new-tokens", "4",
                   "--out", str(tmp_path / "ev")]) == 0
    assert len((tmp_path / "ev" / "samples.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("args,msg", [
    (["--task", "gsm9k"], "unknown task 'gsm9k'"),
    (["--task", "math12k"], "--data"),
    (["--task", "gsm8k", "--data", "nope.jsonl"], "nope.jsonl"),
])
def test_eval_bad_input(make_checkpoint, tmp_path, capsys, args, msg):
    assert E.main(["--model", str(make_checkpoint("qwen2")), "--out", str(tmp_path / "o")]
                  + args) == 2
    assert msg in capsys.readouterr().err


def test_eval_bad_rows_and_adapter(make_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "no answer field here"}) + "\n")
    assert E.main(["--model", str(make_checkpoint("qwen2")), "--task", "gsm8k",
                   "--data", str(bad)]) == 2
    assert "has the field 'question'" in capsys.readouterr().err
    m = M.Model.from_pretrained(make_checkpoint("llama"))  # an adapter for another model shape
    lora.add_lora(m, rank=4, alpha=8)
    lora.save_adapter(m, tmp_path / "ad")
    assert E.main(["--model", str(make_checkpoint("qwen2_oddk")), "--adapter", str(tmp_path / "ad"),
                   "--task", "gsm8k", "--limit", "1"]) == 2
    assert "has shape" in capsys.readouterr().err


class RecordingEngine:
    """Stands in for the rollout engine: records the stop tokens of each call, ends every response
    at once."""

    def __init__(self):
        self.stops = []

    def generate(self, prompts, n=1, stop_token_ids=None, **kw):
        self.stops.append(stop_token_ids)
        end = list(stop_token_ids[:1])
        return [rollout.Sample(i, end, [0.0], "stop")
                for i in range(len(prompts)) for _ in range(n)]


def llama3_chat_folder(make_checkpoint, folder, **tokenizer_kw):
    """A tiny checkpoint whose tokenizer ends turns like Llama 3 (<|eot_id|>, no <|im_end|>), no
    generation_config."""
    from test_data import llama3_style_tokenizer
    shutil.copytree(make_checkpoint("qwen2"), folder)
    for f in folder.iterdir():
        if f.name != "config.json" and f.suffix != ".safetensors":
            f.unlink()
    llama3_style_tokenizer(folder, **tokenizer_kw)
    return folder


def test_eval_stops_on_the_models_own_tokens(make_checkpoint, tmp_path, monkeypatch, capsys):
    from test_data import END_OF_TEXT, EOT
    folder = llama3_chat_folder(make_checkpoint, tmp_path / "llama3-chat")
    engine = RecordingEngine()
    monkeypatch.setattr(E, "make_engine", lambda *a, **k: engine)
    args = ["--model", str(folder), "--task", "gsm8k", "--limit", "2",
            "--out", str(tmp_path / "ev")]
    assert E.main(args) == 0
    # the old hard-coded <|im_end|>/<|endoftext|> gave []
    assert engine.stops == [[END_OF_TEXT, EOT]]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOT, 3]}))
    engine.stops.clear()
    assert E.main(args) == 0
    assert engine.stops == [[EOT, 3, END_OF_TEXT]]
    capsys.readouterr()
    bare = llama3_chat_folder(make_checkpoint, tmp_path / "bare", eos_token=None,
                              template="{{ messages[0]['content'] }}")
    assert E.main(["--model", str(bare), "--task", "gsm8k", "--limit", "2",
                   "--out", str(tmp_path / "ev2")]) == 2
    assert "error: no stop token" in capsys.readouterr().err
