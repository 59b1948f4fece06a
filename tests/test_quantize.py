"""quantize.py: E2M1 encoding, packing, scales, the checkpoint layout, real clients, streaming
memory, bad input."""
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantize as Q
from util import tensorfile

ROOT = Path(__file__).resolve().parent.parent


def load_dir(d: Path) -> dict:
    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def quantized(make_checkpoint, tmp_path, arch, shards=1):
    out = tmp_path / f"{arch}-nvfp4"
    Q.quantize_checkpoint(str(make_checkpoint(arch, shards=shards)), str(out), progress=False)
    return out


# --------------------------------------------------------------------------------------------------
# E2M1 codes, rounding, packing, scales

def test_every_code_roundtrips():
    for code in range(16):
        v = Q.e2m1_values(torch.tensor([code], dtype=torch.uint8))
        expect = Q.E2M1_VALUES[code & 7] * (-1 if code & 8 else 1)
        assert v.item() == expect
        if code != 8:  # -0 is canonicalised to +0
            assert Q.round_e2m1(v).item() == code


@pytest.mark.parametrize("x,code", [
    (0.25, 0),
    (0.2500001, 1),
    (0.75, 2),
    (0.7499999, 1),
    (1.25, 2),
    (1.2500001, 3),
    (1.75, 4),
    (1.7499999, 3),
    (2.5, 4),
    (2.5000002, 5),
    (3.5, 6),
    (3.4999998, 5),
    (5.0, 6),
    (5.0000005, 7),
    (6.0, 7),
    (0.1, 0),
    (-0.1, 0),
    (-0.25, 0),
    (-0.75, 8 | 2),
    (-1.25, 8 | 2),
    (-1.75, 8 | 4),
    (-2.5, 8 | 4),
    (-3.5, 8 | 6),
    (-5.0, 8 | 6),
    (-6.0, 8 | 7),
    (0.6, 1),
    (2.9, 5),
    (4.4, 6)])
def test_rounding_nearest_ties_to_even(x, code):
    assert Q.round_e2m1(torch.tensor([x], dtype=torch.float32)).item() == code


def test_pack_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = Q.pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x97]]
    assert torch.equal(Q.unpack_codes(packed), codes)


def test_block_scales_zero_blocks_and_exact_values():
    torch.manual_seed(0)
    w = torch.randn(4, 64)
    w[1, 16:32] = 0.0                      # an all-zero block
    w[2, :16] = torch.linspace(-3, 3, 16)  # a block whose amax is not the tensor amax
    packed, scale, gs = Q.quantize_weight(w)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 32)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (4, 4)
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    amax = w.abs().max()
    assert gs.item() == pytest.approx(448 * 6 / amax.item(), rel=1e-6)
    # the block holding the tensor amax gets scale 448 and its amax element code +-6
    r, c = divmod(w.abs().argmax().item(), 64)
    assert scale[r, c // 16].float().item() == 448.0
    assert Q.unpack_codes(packed)[r, c].item() & 7 == 7
    # every block scale is fp8(gs * amax_blk / 6)
    expect = (gs * w.reshape(4, 4, 16).abs().amax(-1) / 6).clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(scale.view(torch.uint8), expect.view(torch.uint8))
    # the zero block: scale 0, codes 0, dequantized 0
    assert scale[1, 1].float().item() == 0.0
    assert (Q.unpack_codes(packed)[1, 16:32] == 0).all()
    w_hat = Q.dequantize_weight(packed, scale, gs)
    assert (w_hat[1, 16:32] == 0).all()
    # W_hat is exactly q * s / gs with q in the E2M1 grid
    q = w_hat * gs / scale.float().repeat_interleave(16, 1).clamp(min=1e-30)
    grid = torch.tensor(Q.E2M1_VALUES)
    assert torch.isclose(q.abs()[..., None], grid, rtol=1e-5, atol=1e-6).any(-1).all()


def test_all_zero_tensor():
    packed, scale, gs = Q.quantize_weight(torch.zeros(8, 32))
    assert gs.item() == 1.0 and (packed == 0).all() and (scale.float() == 0).all()


def test_quantization_error_on_gaussian_weights():
    torch.manual_seed(0)
    w = torch.randn(512, 2048)
    w_hat = Q.dequantize_weight(*Q.quantize_weight(w))
    rel = ((w_hat - w).norm() / w.norm()).item()
    print(f"NVFP4 relative Frobenius error on N(0,1) weights: {rel:.4f}")
    # 8 levels per sign with a per-16 fp8 scale: about 9-10% for Gaussian data (measured
    # 0.0953); far from both 0 (no quantization happened) and from a broken scale (errors of 30%+)
    assert 0.08 < rel < 0.11


# --------------------------------------------------------------------------------------------------
# The checkpoint

@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_checkpoint_layout(make_checkpoint, tmp_path, arch):
    src = make_checkpoint(arch)
    out = quantized(make_checkpoint, tmp_path, arch)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    g = qc["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"] and g["input_activations"] is None
    assert g["weights"] == {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                            "strategy": "tensor_group", "dynamic": False}
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
              "generation_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    sd, ref = load_dir(out), load_dir(src)
    n_lin = 0
    for name, t in ref.items():
        if Q.linear_kind(name):
            p = name[:-len(".weight")]
            N, K = t.shape
            assert (sd[p + ".weight_packed"].dtype == torch.uint8
                    and sd[p + ".weight_packed"].shape == (N, K // 2))
            assert (sd[p + ".weight_scale"].dtype == torch.float8_e4m3fn
                    and sd[p + ".weight_scale"].shape == (N, K // 16))
            assert (sd[p + ".weight_global_scale"].dtype == torch.float32
                    and sd[p + ".weight_global_scale"].shape == (1,))
            assert name not in sd
            n_lin += 1
        else:  # embeddings, norms, biases, lm_head: unchanged bf16
            assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], t)
    assert n_lin == 7 * 2
    # q/k/v share one global scale (their joint amax), gate/up share one; o and down have their own
    for i in range(2):
        p = f"model.layers.{i}."
        gs = {k: sd[f"{p}{m}.{k}_proj.weight_global_scale"].item()
              for m, ks in (("self_attn", "qkvo"), ("mlp", ["gate", "up", "down"])) for k in ks}
        amax = lambda *ns: max(ref[f"{p}{n}.weight"].float().abs().max().item() for n in ns)
        assert gs["q"] == gs["k"] == gs["v"] == pytest.approx(
            2688 / amax(*(f"self_attn.{c}_proj" for c in "qkv")))
        assert gs["gate"] == gs["up"] == pytest.approx(2688 / amax("mlp.gate_proj", "mlp.up_proj"))
        assert gs["o"] == pytest.approx(2688 / amax("self_attn.o_proj"))
        assert gs["down"] == pytest.approx(2688 / amax("mlp.down_proj"))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_compressed_tensors_decompresses_to_our_values(make_checkpoint, tmp_path, arch):
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out = quantized(make_checkpoint, tmp_path, arch)
    group = (json.loads((out / "config.json").read_text())
             ["quantization_config"]["config_groups"]["group_0"])
    scheme = QuantizationScheme(**group)
    sd = load_dir(out)
    prefixes = sorted({k[:-len(".weight_packed")] for k in sd if k.endswith(".weight_packed")})
    assert len(prefixes) == 14
    for p in prefixes:
        parts = {k: sd[f"{p}.{k}"]
                 for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(parts, scheme)["weight"]
        ours = Q.dequantize_weight(parts["weight_packed"], parts["weight_scale"],
                                   parts["weight_global_scale"], dtype=theirs.dtype)
        assert torch.equal(theirs, ours), p


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_transformers_loads_quantized_folder(make_checkpoint, tmp_path, arch):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = quantized(make_checkpoint, tmp_path, arch)
    sd = load_dir(out)
    deq = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    for name, w in deq.state_dict().items():
        if Q.linear_kind(name):
            p = name[:-len(".weight")]
            ours = Q.dequantize_weight(sd[p + ".weight_packed"], sd[p + ".weight_scale"],
                                       sd[p + ".weight_global_scale"], dtype=torch.bfloat16)
            assert torch.equal(w, ours), name
    # compressed modules, decompressed on the fly
    compressed = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[3838, 374, 220, 17, 10, 18, 30]])  # "What is 2+3?"
    with torch.no_grad():
        assert torch.equal(deq(ids).logits, compressed(ids).logits)


def test_odd_k_linear_kept_bf16_and_ignored(make_checkpoint, tmp_path):
    out = quantized(make_checkpoint, tmp_path, "qwen2_oddk")
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    sd = load_dir(out)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (64, 72)
    assert "model.layers.0.mlp.down_proj.weight_packed" not in sd
    assert "model.layers.0.mlp.up_proj.weight_packed" in sd
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))


def test_sharded_input_and_library_function_match_cli(make_checkpoint, tmp_path):
    one = load_dir(quantized(make_checkpoint, tmp_path, "qwen2", shards=1))
    src3 = make_checkpoint("qwen2", shards=3)
    assert (src3 / "model.safetensors.index.json").exists()
    out3 = tmp_path / "three"
    Q.quantize_checkpoint(str(src3), str(out3), shard_mb=8, progress=False)  # sharded output too
    assert ((out3 / "model.safetensors.index.json").exists()
            and len(list(out3.glob("*.safetensors"))) > 1)
    three = load_dir(out3)
    lib, ignore = Q.quantize_state_dict(load_dir(make_checkpoint("qwen2")))
    assert ignore == [] and one.keys() == three.keys() == lib.keys()
    for k in one:
        for other in (three, lib):
            assert one[k].dtype == other[k].dtype
            assert torch.equal(
                one[k].view(torch.uint8) if one[k].dtype == torch.float8_e4m3fn else one[k],
                (other[k].view(torch.uint8) if other[k].dtype == torch.float8_e4m3fn
                 else other[k])), k


# --------------------------------------------------------------------------------------------------
# Streaming: peak memory stays bounded by the chunk buffers, not by the model

MEM_SCRIPT = r"""
import resource, sys
sys.path.insert(0, sys.argv[1])
import quantize
def rss_mb(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
base = rss_mb('VmRSS')
rc = quantize.main(['--model', sys.argv[2], '--out', sys.argv[3], '--chunk-mb', '16',
                    '--quiet', '--device', 'cpu'])
print('PEAK_MB', rss_mb('VmHWM') - base, rc)
"""


def write_big_llama(path: Path, layers=6, hidden=1024, inter=4096, vocab=8192):
    """A Llama-shaped checkpoint of random bf16 tensors (~200 MB in 3 shards), written without
    transformers."""
    path.mkdir()
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
               intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=8,
               num_key_value_heads=8, vocab_size=vocab)
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: (0.02 * torch.randn(*s, generator=g)).to(torch.bfloat16)
    shards = [{"model.embed_tokens.weight": rnd(vocab, hidden),
               "lm_head.weight": rnd(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)},
              {},
              {}]
    for i in range(layers):
        p, sh = f"model.layers.{i}.", shards[1 + i % 2]
        for n in ("q", "k", "v", "o"):
            sh[f"{p}self_attn.{n}_proj.weight"] = rnd(hidden, hidden)
        sh[f"{p}mlp.gate_proj.weight"] = rnd(inter, hidden)
        sh[f"{p}mlp.up_proj.weight"] = rnd(inter, hidden)
        sh[f"{p}mlp.down_proj.weight"] = rnd(hidden, inter)
        for n in ("input_layernorm", "post_attention_layernorm"):
            sh[f"{p}{n}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    wm = {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(sh, path / fn)
        wm.update({k: fn for k in sh})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def test_streaming_peak_memory_is_bounded(tmp_path):
    src = tmp_path / "big"
    total = write_big_llama(src)
    largest = 4096 * 1024 * 2
    r = subprocess.run([sys.executable, "-c", MEM_SCRIPT, str(ROOT), str(src),
                        str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    peak = float(r.stdout.split("PEAK_MB")[1].split()[0])
    print(f"checkpoint {total / 2**20:.0f} MB, largest tensor {largest / 2**20:.0f} MB, "
          f"peak RSS above the imports {peak:.0f} MB (chunk 16 MB)")
    # Bound: about 7 chunk buffers (raw rows, fp32 copy, clamp, codes, error) = 8 x 16 MB, whatever
    # the model size; measured ~110 MB here for a ~220 MB checkpoint, and the same for a 3x larger
    # one.
    assert peak < 8 * 16, peak
    assert peak < total / 2**20 / 1.5
    sd = load_dir(tmp_path / "out")
    assert sd["model.layers.3.mlp.down_proj.weight_packed"].shape == (1024, 2048)


# --------------------------------------------------------------------------------------------------
# Bad input: one line, non-zero exit, nothing at --out

def run_cli(args, capsys):
    rc = Q.main(args + ["--quiet", "--device", "cpu"])
    err = capsys.readouterr().err
    return rc, err


def assert_nothing_left(out: Path):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


def copy_ckpt(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_bad_no_safetensors(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    rc, err = run_cli(["--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "has no *.safetensors files" in err
    assert_nothing_left(tmp_path / "o")


def test_bad_missing_folder(tmp_path, capsys):
    rc, err = run_cli(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "no such folder" in err


def test_bad_unsupported_arch(make_checkpoint, tmp_path, capsys):
    src = copy_ckpt(make_checkpoint("qwen2"), tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(["--model", str(src), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "GPT2LMHeadModel is not supported" in err and "Qwen3ForCausalLM" in err
    assert_nothing_left(tmp_path / "o")


def test_bad_nan_names_tensor(make_checkpoint, tmp_path, capsys):
    src = copy_ckpt(make_checkpoint("qwen2"), tmp_path / "m")
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(sd, src / "model.safetensors")
    rc, err = run_cli(["--model", str(src), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "model.layers.1.mlp.up_proj.weight contains NaN or Inf" in err
    assert_nothing_left(tmp_path / "o")


def test_bad_out_exists_then_overwrite(make_checkpoint, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc, err = run_cli(["--model", str(make_checkpoint("qwen2")), "--out", str(out)], capsys)
    assert (rc == 2 and "already exists" in err and "--overwrite" in err
            and (out / "keep.txt").exists())
    rc, _ = run_cli(["--model", str(make_checkpoint("qwen2")), "--out", str(out), "--overwrite"],
                    capsys)
    assert rc == 0 and not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_bad_already_quantized(make_checkpoint, tmp_path, capsys):
    q = quantized(make_checkpoint, tmp_path, "qwen2")
    rc, err = run_cli(["--model", str(q), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "already quantized" in err
    cfg = json.loads((q / "config.json").read_text())  # tensors alone also give it away
    del cfg["quantization_config"]
    (q / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(["--model", str(q), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "already quantized" in err and "weight_packed" in err
    assert_nothing_left(tmp_path / "o")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_bad_corrupt_or_truncated(make_checkpoint, tmp_path, capsys, damage):
    src = copy_ckpt(make_checkpoint("qwen2"), tmp_path / "m")
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate"
                  else struct.pack("<Q", 10**6) + b"{not json")
    rc, err = run_cli(["--model", str(src), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and ("truncated" in err if damage == "truncate"
                        else "not a valid safetensors file" in err)
    assert_nothing_left(tmp_path / "o")


def test_interrupted_run_leaves_nothing(make_checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "o"
    calls = {"n": 0}
    real = tensorfile.ShardWriter.write_rows

    def boom(self, *a):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, *a)

    monkeypatch.setattr(tensorfile.ShardWriter, "write_rows", boom)
    assert Q.main(["--model", str(make_checkpoint("qwen2")), "--out", str(out),
                   "--quiet", "--device", "cpu"]) == 130
    assert_nothing_left(out)


def test_cli_summary_and_default_out(make_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    src = make_checkpoint("qwen3")
    assert Q.main(["--model", str(src), "--quiet", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / f"{src.name}-NVFP4" / "config.json").exists()
    assert "14 linears quantized" in out and "down_proj" in out and "worst" in out
    assert '"overwrite": false' in out  # the config is printed at start
    assert math.isfinite(float(out.split("q_proj     mean ")[1].split()[0]))
