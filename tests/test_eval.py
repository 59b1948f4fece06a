"""eval.py: pass@k, an end-to-end evaluation of tiny models (bf16, NVFP4 + adapter) on GSM8K rows, and bad input."""
import json

import pytest
import torch

import eval as E
import lora
import model as M
import quantize as Q


def test_pass_at_k_unbiased_estimator():
    assert E.pass_at_k(4, 1, 1) == 0.25
    assert E.pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)      # 1 - C(3,2)/C(4,2)
    assert E.pass_at_k(8, 3, 4) == pytest.approx(1 - 5 / 70)     # 1 - C(5,4)/C(8,4)
    assert E.pass_at_k(4, 0, 4) == 0.0 and E.pass_at_k(4, 4, 1) == 1.0


def test_eval_end_to_end_bf16(make_checkpoint, tmp_path, capsys):
    out = tmp_path / "ev"
    rc = E.main(["--model", str(make_checkpoint("qwen2")), "--task", "gsm8k", "--limit", "3", "--n", "2",
                 "--temperature", "1.0", "--max-new-tokens", "6", "--out", str(out)])
    assert rc == 0
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and {"question", "gold", "response", "pred", "correct", "parse_failed", "length"} <= set(lines[0])
    assert lines[0]["gold"] == "18"  # the first GSM8K test row (Janet's ducks)
    s = json.loads((out / "summary.json").read_text())
    assert s["prompts"] == 3 and s["samples_per_prompt"] == 2 and "pass@2" in s and 0 <= s["pass@1"] <= 1
    assert s["mean_length"] <= 6 and s["parse_fail_rate"] == sum(x["parse_failed"] for x in lines) / 6
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
    assert E.main(["--model", str(tmp_path / "q"), "--adapter", str(tmp_path / "ad"), "--task", "synthetic",
                   "--limit", "4", "--max-new-tokens", "4", "--out", str(tmp_path / "ev")]) == 0
    assert len((tmp_path / "ev" / "samples.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("args,msg", [
    (["--task", "gsm9k"], "unknown task 'gsm9k'"),
    (["--task", "math12k"], "--data"),
    (["--task", "gsm8k", "--data", "nope.jsonl"], "nope.jsonl"),
])
def test_eval_bad_input(make_checkpoint, tmp_path, capsys, args, msg):
    assert E.main(["--model", str(make_checkpoint("qwen2")), "--out", str(tmp_path / "o")] + args) == 2
    assert msg in capsys.readouterr().err


def test_eval_bad_rows_and_adapter(make_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "no answer field here"}) + "\n")
    assert E.main(["--model", str(make_checkpoint("qwen2")), "--task", "gsm8k", "--data", str(bad)]) == 2
    assert "has the field 'question'" in capsys.readouterr().err
    m = M.Model.from_pretrained(make_checkpoint("llama"))  # an adapter for another model shape
    lora.add_lora(m, rank=4, alpha=8)
    lora.save_adapter(m, tmp_path / "ad")
    assert E.main(["--model", str(make_checkpoint("qwen2_oddk")), "--adapter", str(tmp_path / "ad"), "--task", "gsm8k",
                   "--limit", "1"]) == 2
    assert "has shape" in capsys.readouterr().err
