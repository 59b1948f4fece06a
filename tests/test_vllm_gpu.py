"""vllm_backend/engine.py on a CUDA GPU: vLLM runs our Triton NVFP4 GEMM in bf16, with LoRA sync,
AQN noise and sleep / wake.

    pytest -q -s -m vllm tests/test_vllm_gpu.py
    # needs a GPU build of vLLM and a Hopper GPU; skipped elsewhere

Every test runs twice: vLLM eager (the default), and with its torch.compile + CUDA graphs
(enforce_eager=False). A vLLM install without FlashInfer needs VLLM_USE_FLASHINFER_SAMPLER=0 (its
sampler imports it otherwise).

tests/test_vllm.py checks the same backend on CPU in fp32, where vLLM, our model and transformers
agree to 1e-4. Here everything runs in bf16 on the GPU: vLLM's attention, norm and rotary kernels
round differently from ours, so log-probs are compared with TOL = 0.02 nats (the H100 measured
0.002-0.007; each test prints its gaps) and a greedy token is checked to be our model's argmax up to
TOL. Every effect a test relies on (an adapter, a noise draw) must move the log-probs by more than
5 x TOL, so each comparison can fail.
"""
import os

import pytest
import torch

pytest.importorskip("vllm")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import kernels  # noqa: E402
import lora  # noqa: E402
import model as M  # noqa: E402
import noise  # noqa: E402
import quantize as Q  # noqa: E402
from vllm_backend import engine as RV  # noqa: E402
from vllm_backend import plugin  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPTS = [[3838, 374, 220, 17, 10, 18, 30], [40, 1079, 264],
           [9707, 11, 1879, 0, 576, 4226, 374, 25, 17, 10]]
TOL = 0.02
CALLS = []   # (device, dtype) of every nvfp4_linear call made inside vLLM


def gap(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def continuation(m, prompt, tokens):
    """(ids (1, T), hidden states (len(tokens), H)) of our model m: the states that predict each of
    `tokens`."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        h = m.forward_padded(ids, torch.ones_like(ids, dtype=torch.bool))[0]  # (T, H)
    return ids, h[len(prompt) - 1:-1]


@pytest.fixture(scope="module", params=[True, False], ids=["eager", "graphs"])
def setup(request, make_checkpoint, tmp_path_factory):
    """(engine, our model, eager): vLLM eager, then with its torch.compile + CUDA graphs
    (enforce_eager=False)."""
    folder = tmp_path_factory.mktemp("vllm-gpu") / "qwen2-nvfp4"
    Q.quantize_checkpoint(str(make_checkpoint("qwen2")), str(folder), progress=False)
    real = kernels.nvfp4_linear

    def recorded(x, w, bias=None):
        CALLS.append((x.device.type, x.dtype))
        return real(x, w, bias)

    kernels.nvfp4_linear = recorded  # the vLLM backend's custom op looks it up at every call
    # the eager engine had sleep mode: a second one is a clear error
    if plugin.STATS["sleep_engines"]:
        with pytest.raises(RuntimeError, match="one engine per process"):
            RV.VLLMEngine(str(folder), max_model_len=128, dtype="bfloat16")
    eng = RV.VLLMEngine(str(folder), max_model_len=128, dtype="bfloat16", max_lora_rank=16,
                        gpu_memory_utilization=0.3, enforce_eager=request.param,
                        # vLLM's sleep-mode allocator: one engine a process
                        enable_sleep_mode=request.param)
    ours = M.Model.from_pretrained(str(folder), "cuda", torch.bfloat16)
    yield eng, ours, request.param
    eng.close()
    kernels.nvfp4_linear = real


@pytest.fixture
def eng(setup):
    e, ours, _ = setup
    e.wake()
    e.set_noise(None)
    e.sync_lora(None)
    yield e
    e.wake()


@pytest.fixture
def ours(setup):
    return setup[1]


def test_our_triton_gemm_runs_inside_vllm(setup, eng):
    CALLS.clear()
    out = eng.generate([PROMPTS[0]], max_new_tokens=5, temperature=0.0, stop_token_ids=[])[0]
    assert len(out.tokens) == 5
    if setup[2]:
        # 4 linears x 2 layers x 5 forward steps
        assert len(CALLS) == 4 * 2 * 5
        # the Triton path (the reference is CPU / fp32)
        assert set(CALLS) == {("cuda", torch.bfloat16)}
    else:  # decode steps replay captured CUDA graphs
        assert len(CALLS) < 4 * 2 * 5 and set(CALLS) <= {("cuda", torch.bfloat16)}


def test_prompt_logprobs_match_ours(eng, ours):
    g = gap(eng.prompt_logprobs(PROMPTS), RV.trainer_prompt_logprobs(ours, PROMPTS))
    print(f"\nprompt log-prob gap vLLM vs our model (bf16, GPU): {g:.4f}")
    assert g < TOL


def test_greedy_tokens_are_our_argmax(eng, ours):
    out = eng.generate(PROMPTS, max_new_tokens=8, temperature=0.0, stop_token_ids=[])
    worst = 0.0
    for s in out:
        ids, h = continuation(ours, PROMPTS[s.prompt_idx], s.tokens)
        with torch.no_grad():
            lp = torch.log_softmax(ours.logits(h).float(), -1)                             # (8, V)
        picked = lp.gather(-1, torch.tensor(s.tokens, device="cuda")[:, None])[:, 0]
        worst = max(worst, (lp.max(-1).values - picked).max().item())
    print(f"\ngreedy: largest (our max log-prob - ours at vLLM's pick): {worst:.4f}")
    assert worst < TOL


def test_sampled_logprobs_and_seeds(eng, ours):
    out = eng.generate(PROMPTS[:2], n=3, max_new_tokens=6, temperature=0.7, seed=1,
                       stop_token_ids=[])
    ref = []
    for s in out:
        ids, h = continuation(ours, PROMPTS[s.prompt_idx], s.tokens)
        with torch.no_grad():
            ref.append(M.token_logprobs(ours, h, ids[0, -len(s.tokens):], 0.7)[0].float().tolist())
    g = gap([s.logprobs for s in out], ref)
    print(f"\nsampled log-prob gap (temperature 0.7): {g:.4f}")
    assert g < TOL
    assert eng.generate(PROMPTS[:2], n=3, max_new_tokens=6, temperature=0.7, seed=1,
                        stop_token_ids=[]) == out


def test_lora_sync_on_gpu(eng, ours):
    base = eng.prompt_logprobs(PROMPTS)
    lora.add_lora(ours, rank=8, alpha=16, seed=1)
    try:
        g = torch.Generator().manual_seed(2)
        for step in range(2):  # two "optimizer steps" on B, a sync after each
            with torch.no_grad():
                for _, lin in ours.linears():
                    lin.lora_B.add_((torch.randn(lin.lora_B.shape, generator=g) * 0.3)
                                    .to(lin.lora_B))
            stale = eng.probe_gap(ours, PROMPTS)  # before the sync the probe must see the change
            synced = eng.sync_lora(ours, probe=PROMPTS)
            moved = gap(eng.prompt_logprobs(PROMPTS), base)
            print(f"\nLoRA step {step}: probe gap before sync {stale:.4f}, after {synced:.4f}; "
                  f"moved {moved:.3f}")
            assert synced < TOL and stale > 5 * TOL and moved > 5 * TOL
        eng.sync_lora(None)
        assert gap(eng.prompt_logprobs(PROMPTS), base) < TOL / 10
    finally:
        for _, lin in ours.linears():  # back to the plain base for the other tests
            with torch.no_grad():
                lin.lora_B.zero_()


def test_noise_on_gpu_never_accumulates(eng, ours):
    def norms(model):
        return [(l.input_layernorm.weight.detach().clone(),
                 l.post_attention_layernorm.weight.detach().clone())
                for l in model.model.layers]

    clean_w, clean = eng.llm.apply_model(norms)[0], eng.prompt_logprobs(PROMPTS)
    z = noise.sample(2, 64, 1.0, torch.Generator().manual_seed(0))
    for _ in range(3):
        eng.set_noise(z)                                             # three times = once
    w = eng.llm.apply_model(norms)[0]
    assert all(torch.equal(w[i][j], (clean_w[i][j].float() + z[i, j].cuda()).to(w[i][j].dtype))
               for i in range(2) for j in range(2))
    noisy = eng.prompt_logprobs(PROMPTS)
    g, moved = gap(noisy, RV.trainer_prompt_logprobs(ours, PROMPTS, z.cuda())), gap(noisy, clean)
    print(f"\nnoise: gap vLLM vs ours {g:.4f}, moved {moved:.3f}")
    assert g < TOL and moved > 5 * TOL
    eng.set_noise(None)
    assert gap(eng.prompt_logprobs(PROMPTS), clean) < TOL / 10
    assert all(torch.equal(a, b) for x, y in zip(eng.llm.apply_model(norms)[0], clean_w)
               for a, b in zip(x, y))


def test_sleep_frees_memory_and_wake_restores(eng):
    if not eng.can_sleep:
        pytest.skip("sleep mode is on for the first (eager) engine only: "
                    "vLLM allows it once per process")
    torch.cuda.empty_cache()
    before = eng.generate(PROMPTS, max_new_tokens=4, temperature=0.0, stop_token_ids=[])
    free0 = torch.cuda.mem_get_info()[0]
    eng.sleep()
    freed = (torch.cuda.mem_get_info()[0] - free0) / 2**30
    print(f"\nsleep freed {freed:.1f} GiB")
    assert freed > 5  # the KV cache of gpu_memory_utilization=0.3
    eng.wake()
    assert eng.generate(PROMPTS, max_new_tokens=4, temperature=0.0, stop_token_ids=[]) == before
