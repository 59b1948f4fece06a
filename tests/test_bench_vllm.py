"""bench/vllm_speed.py without a GPU or vLLM: the job plan, the table's ratios, the error it
reports for a failed job, and that its random folders and adapter (bench/peer_folders.py) load in
our model as they load in vLLM. The timing itself runs on a GPU (`python -m bench vllm`); a CPU
smoke run of it is in tests/test_vllm.py."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import lora
import model as M
import quantize
from bench import peer_folders
from bench import vllm_speed as V

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)


def plan(**kw):
    args = dict(engines=list(V.ENGINES), shapes=["7b", "32b"], batches=[1, 16, 64, 256],
                lora_rank=32, prompt=256, new_tokens=512, dir=Path("/x"))
    return V.make_jobs(SimpleNamespace(**{**args, **kw}))


def test_job_plan():
    jobs = plan()
    by = {(j["engine"], j["shape"], j["lora_rank"], tuple(j["batches"])) for j in jobs}
    # vLLM sizes its KV cache and graphs at start: one engine up to batch 64 (memory read there),
    # one for 256
    assert ("vllm-bf16", "7b", 32, (1, 16, 64)) in by and ("vllm-bf16", "7b", 32, (256,)) in by
    # the built-in engine is sized per batch inside one job
    assert ("built-in-bf16", "7b", 0, (1, 16, 64, 256)) in by
    # 32B: NVFP4 engines only, batch 1 and 16
    big = {(e, b) for e, s, _, b in by if s == "32b"}
    assert big == {("vllm-nvfp4", (1, 16)), ("built-in-nvfp4", (1, 16))}
    assert len(jobs) == 3 * 2 * 2 + 2 * 2 + 2 * 2
    assert {j["lora_rank"] for j in plan(lora_rank=0)} == {0}


def row(engine, rank, batch, tok_s, **kw):
    return dict(engine=engine, shape="7b", lora_rank=rank, kind="time", batch=batch, tok_s=tok_s,
                **kw)


def test_table_ratios_and_errors():
    done = dict(engine="vllm-bf16", shape="7b", lora_rank=0, kind="done", batches=[1])
    rows = [row("built-in-nvfp4", 0, 1, 300.0), row("vllm-bf16", 0, 1, 120.0, mem_GB=24.4),
            row("built-in-nvfp4", 32, 1, 200.0), row("vllm-nvfp4", 32, 1, 160.0),
            dict(engine="vllm-bf16", shape="7b", lora_rank=0, kind="error", batches=[1],
                 error="old failure"),
            done,
            dict(engine="vllm-ours", shape="7b", lora_rank=0, kind="error", batches=[1],
                 error="ValueError: no GPU")]
    args = SimpleNamespace(engines=list(V.ENGINES), shapes=["7b"], batches=[1], lora_rank=32)
    text = V.table(rows, args)
    # 300 / 120, and no memory read at batch 1
    assert "| vllm-bf16 | off | 120 (2.50x) | - |" in text
    assert "| vllm-nvfp4 | 32 | 160 (1.25x) | - |" in text      # 200 / 160: at the same LoRA
    assert "| built-in-nvfp4 | off | 300 | - |" in text          # no ratio against itself
    assert "old failure" not in text                            # a rerun of that job finished
    assert "vllm-ours 7b LoRA off failed: ValueError: no GPU" in text


def test_root_cause_reads_only_the_rerun(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("ModuleNotFoundError: No module named 'old'\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("WARNING x ImportError: ignored\n"
                "(EngineCore) ValueError: Marlin FP4 not available\n"
                "RuntimeError: Engine core initialization failed\n")
    assert V.root_cause(log, start, 1) == "ValueError: Marlin FP4 not available (job.log)"
    assert V.root_cause(tmp_path / "missing.log", 0, 137) == "exit code 137 (missing.log)"


def test_folders_and_adapter_load_in_our_model(tmp_path):
    bf16 = peer_folders.write_folder(tmp_path / "bf16", TINY, "bf16", "cpu")
    nvfp4 = peer_folders.write_folder(tmp_path / "nvfp4", TINY, "nvfp4", "cpu")
    adapter = peer_folders.write_adapter(tmp_path / "lora", TINY, 4)
    assert "quantization_config" in json.loads((nvfp4 / "config.json").read_text())
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    for folder in (bf16, nvfp4):
        m = M.Model.from_pretrained(str(folder), "cpu", torch.float32)
        lora.load_adapter(m, adapter)            # PEFT names and shapes, every decoder linear
        assert m.lora_config["r"] == 4
        assert len(lora.lora_parameters(m)) == 2 * 7 * TINY["num_hidden_layers"]
        h = m.forward_padded(ids, torch.ones_like(ids, dtype=torch.bool))
        with lora.disabled(m):
            h0 = m.forward_padded(ids, torch.ones_like(ids, dtype=torch.bool))
        assert (h - h0).abs().max() > 1e-3       # nonzero B: the adapter changes the output
    # the NVFP4 folder is the bf16 one quantized (the same draw): relative error of NVFP4 (~0.1),
    # where another draw would give sqrt(2)
    a, b = load_file(bf16 / "model.safetensors"), load_file(nvfp4 / "model.safetensors")
    k = "model.layers.1.mlp.down_proj."
    w = a[k + "weight"].float()
    q = quantize.dequantize_weight(b[k + "weight_packed"], b[k + "weight_scale"],
                                   b[k + "weight_global_scale"])
    assert (q - w).norm() / w.norm() < 0.2


@pytest.mark.parametrize("bad", [["--engines", "vllm-fp8"], ["--shapes", "70b"],
                                 ["--batches", "1,x"]])
def test_bad_flags_are_one_line(bad, capsys):
    with pytest.raises(SystemExit) as e:
        V.main(bad)
    assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
