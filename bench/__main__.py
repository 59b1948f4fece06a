"""python -m bench: the GPU measurements behind the README's results table (random weights of real
shapes).

    python -m bench kernels                 # NVFP4 GEMM vs torch bf16 at the Qwen2.5-7B linear
                                            # shapes, dgrad, RMSNorm
    python -m bench kernels --sweep         # also try the candidate tile configs per (shape, M)
                                            # and print the best
    python -m bench kernels --parts ablate  # the GEMM with one stage changed (token traffic,
                                            # split-K fixup)
    python -m bench kernels --parts splits  # every split-K count per shape at M = 1 / 16 / 64
    python -m bench kernels --parts ws      # gemm/warp_specialized.py's GEMM vs the Triton one,
                                            # 32-768 tokens
    python -m bench kernels --parts stamps  # where kernels_ws's programs spend their time
                                            # (global-timer stamps)
    python -m bench model | rollout | train # memory and fwd + bwd; tokens/s of generation; one RL
                                            # step (see --help)
    python -m bench profile [--train nvfp4] # where a decode step (or an RL step's train half)
                                            # spends its time
    python -m bench kernels --parts attn    # decode attention (layers/attention.py) vs torch SDPA
    python -m bench kernels --parts lora    # what a rank-32 LoRA adds to each fused linear of a
                                            # decode step, and three ways of its A product
    python -m bench rollout --lora-paths    # the same in the whole rollout: adapters off / on
                                            # through each A-product path, medians of rounds
    python -m bench kernels --parts gemm --portable   # the GEMM table on the path non-Hopper
                                                      # GPUs take
    python -m bench vllm                    # rollout against vLLM: bf16, its own NVFP4 path, our
                                            # GEMM (vllm --help: .venv-vllm, 42 GB of random
                                            # checkpoints under --dir, removed at the end)
    python -m bench dist [--smoke]          # weak / strong scaling of an RL step over 1, 2, 4 GPUs
                                            # (torchrun)

Run it from the repository root (python -m puts the root on sys.path, so the stage modules import).
The entry point only parses flags and dispatches; the measurements live below it and import their
shared machinery from bench/common.py, never from here:
    common.py        shapes, CUDA-graph timing (paired_us), random NVFP4 weights and random
                     Qwen2.5-shaped models
    kernel_speed.py  kernels: the GEMM, dgrad and RMSNorm tables
    sweep.py         kernels --sweep and the other --parts (ablate, splits, ws, stamps, sampler,
                     attn)
    lora_speed.py    kernels --parts lora
    model_speed.py   model, rollout, train
    profiling.py     profile, one
    vllm_speed.py    vllm (flags of its own)
    peer_folders.py  the random checkpoints and LoRA adapter vllm gives every engine
    scaling.py       dist (flags of its own; each GPU count is a torchrun job running
                     bench/scaling.py --worker)

At M <= 64 the GEMM table also times cuBLAS bf16 on a weight of as many bytes as the NVFP4 one
(9/32 of the rows: "same-bytes bound") and a kernel that only streams the NVFP4 words and scales
("read floor", an estimate).
Timing: CUDA graphs of many calls (launch gaps excluded), the median of several replays, the two
sides of a ratio replayed in turn (paired_us); weights rotate over enough copies that every call
reads them from HBM, not L2 (50 MB).
Speedups are ours / torch bf16 measured in the same run. Needs a CUDA GPU.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from util import fsutil
from bench.common import QWEN, SHAPES_7B, SHAPES_32B, copy_bandwidth


def vllm(argv):
    from bench import vllm_speed

    return vllm_speed.main(argv) or 0


def dist(argv):
    from bench import scaling

    return scaling.main(argv) or 0


# Subcommands with flags of their own: their module's main gets the rest of the command line.
OWN_FLAGS = {"vllm": vllm, "dist": dist}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OWN_FLAGS:
        return OWN_FLAGS[argv[0]](argv[1:])
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="nanoqerl GPU benchmarks (print measured numbers; need a CUDA GPU).")
    ap.add_argument("what",
                    choices=["kernels", "model", "rollout", "train", "one", "profile", *OWN_FLAGS],
                    help="kernels: GEMM/dgrad/RMSNorm tables; model: memory and fwd+bwd; "
                         "rollout: tokens/s; train: one RL step; "
                         "one: a single GEMM (for profilers); "
                         "profile: CUDA time per kernel of a decode step "
                         "(--size, first of --batches) or of an RL step's train half (--train); "
                         "vllm: rollout tokens/s of vLLM (bf16, its NVFP4 path, our GEMM) "
                         "and the built-in engine (its own flags: python -m bench vllm --help); "
                         "dist: scaling over GPUs (python -m bench dist --help)")
    ap.add_argument("--size", default="7b", choices=sorted(QWEN),
                    help="model shape for model / rollout / train, "
                         "and the linear shapes of `kernels --parts gemm`")
    ap.add_argument("--batches", default="1,16,64,256",
                    help="with rollout: batch sizes (sequences)")
    ap.add_argument("--new-tokens", type=int, default=512,
                    help="with rollout / train: tokens generated per sequence")
    ap.add_argument("--no-hf", action="store_true", help="with rollout: skip transformers generate")
    ap.add_argument("--no-grad-checkpoint", action="store_true",
                    help="with train: keep every layer's activations "
                         "instead of recomputing them in backward")
    ap.add_argument("--old-logp", default="reuse", choices=["pass", "reuse", "both"],
                    help="with train: train.py's --old-logp for the train half (reuse: its "
                         "default with one epoch); both: the pass, then reuse, on the same "
                         "rollout batch (train_s and train_s_reuse)")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="with profile / rollout: LoRA of this rank on every linear "
                         "(random nonzero B)")
    ap.add_argument("--lora-paths", action="store_true",
                    help="with rollout: NVFP4 only, the LoRA (--lora-rank, default 32) off and on "
                         "through each way of its A product (cuBLAS, lora_shrink, also the "
                         "norm-fused ones, also o_proj's in the attention), in turn, --rounds "
                         "times; prints each path's median cost against the adapters off "
                         "(bench/lora_speed.rollout_paths)")
    ap.add_argument("--paths", default=None,
                    help="with rollout --lora-paths: the paths to time, comma-separated (off is "
                         "always timed: every cost is against it); default: all of "
                         "bench/lora_speed.PATHS")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with rollout --lora-paths: rounds of every path (medians over them)")
    ap.add_argument("--bases", default="nvfp4,bf16", help="with rollout: the base weights to time")
    ap.add_argument("--train", default=None, choices=["nvfp4", "bf16"],
                    help="with profile: the train half of `train` (this base) "
                         "instead of a decode step")
    ap.add_argument("--prefill", action="store_true",
                    help="with profile: host time of the eager prefill (first of --batches), "
                         "NVFP4 and bf16")
    ap.add_argument("--ab", default=None, choices=["attn", "silu", "rope"],
                    help="with profile: the decode step with a knob on and off, "
                         "same run (--batches): attn: our decode attention vs torch SDPA; "
                         "silu: SiLU x up in gate_up's epilogue vs a kernel of its own; "
                         "rope: RoPE + cache write in the attention or not")
    ap.add_argument("--shape", default="gate_up", choices=sorted(SHAPES_7B),
                    help="with `one`: the 7B linear shape")
    ap.add_argument("--config", default=None,
                    help="with `one`: a JSON tile config (default: the dispatch table)")
    ap.add_argument("--iters", type=int, default=3,
                    help="with `one`: calls to make (each of ours and of F.linear)")
    ap.add_argument("--sweep", nargs="?", const="all", default=None,
                    choices=["all", "wgmma", "mma", "ks"],
                    help="also time the candidate GEMM configs per (shape, M); "
                         "optionally only the wgmma (4-8 warps) "
                         "or the mma.sync (1-2 warps or BN < 64) family, "
                         "or the K-sliced kernel's configs (ks)")
    ap.add_argument("--m", default="1,16,64,256,4096", help="token counts M for the GEMM table")
    ap.add_argument("--parts", default="gemm,dgrad,rmsnorm",
                    help="which kernel benchmarks to run (comma list of gemm, dgrad, rmsnorm; "
                         "also ablate: the GEMM with one stage changed, "
                         "splits: every split-K count at M = 1 / 16 / 64, "
                         "ws: the warp-specialized GEMM of kernels_ws against the Triton one, "
                         "stamps: where its programs' time goes, "
                         "sampler: race_sample chunked vs one program a row, "
                         "attn: decode attention vs SDPA; see bench/sweep.py; "
                         "lora: a rank-32 LoRA's cost in each fused linear at the --m values up "
                         "to 64, bench/lora_speed.py)")
    ap.add_argument("--ws-m", default="32,48,64,96,128,160,192,224,256,384,512,768",
                    help="with --parts ws: token counts M")
    ap.add_argument("--portable", action="store_true",
                    help="run the path non-Hopper GPUs take (as NANOQERL_PORTABLE=1): "
                         "no kernels_ws GEMM, the portable PTX; "
                         "the GEMM table says which path and which GEMM each row ran")
    ap.add_argument("--json", default=None, help="also write all numbers to this JSON file")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    from bench.lora_speed import SWITCHES
    from layers import shrink
    # the environment's LoRA A-product switches (NANOQERL_LORA_*), which the config above omits
    print("lora switches:", json.dumps({k: getattr(shrink, k) for k in SWITCHES}))
    if args.rounds < 1:
        print(f"error: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    from bench.lora_speed import PATHS
    paths = list(PATHS) if args.paths is None else ["off"] + [
        p for p in args.paths.split(",") if p != "off"]
    if unknown := [p for p in paths if p not in PATHS]:
        print(f"error: --paths {','.join(unknown)}: not a path; the paths are "
              f"{', '.join(PATHS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: python -m bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.portable:
        import kernels
        kernels.PORTABLE = True   # read at every call: every stage below takes the portable path
    if args.what in ("profile", "one"):
        from bench import profiling
        return profiling.run(args) or 0
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.what in ("model", "rollout", "train"):
        from bench.model_speed import bench_model, bench_rl_step, bench_rollout
        out["copy_GBps"] = copy_bandwidth()
        print(f"device {torch.cuda.get_device_name()}  copy bandwidth {out['copy_GBps']:.0f} GB/s")
        if args.what == "model":
            bench_model(out, args.size)
        elif args.what == "rollout" and args.lora_paths:
            from bench.lora_speed import rollout_paths
            rollout_paths(out, args.size, [int(b) for b in args.batches.split(",")],
                          args.new_tokens, 256, args.lora_rank or 32, args.rounds, paths)
        elif args.what == "rollout":
            bench_rollout(out, args.size, [int(b) for b in args.batches.split(",")],
                          args.new_tokens, hf=not args.no_hf, lora_rank=args.lora_rank,
                          bases=args.bases.split(","))
        else:
            modes = ("pass", "reuse") if args.old_logp == "both" else (args.old_logp,)
            bench_rl_step(out, args.size, new_tokens=args.new_tokens,
                          recompute=not args.no_grad_checkpoint, old_logps=modes)
    parts = args.parts.split(",") if args.what == "kernels" else []
    if parts:
        from bench import sweep
        from bench.kernel_speed import bench_dgrad, bench_gemm, bench_rmsnorm
    if "gemm" in parts:
        shapes = SHAPES_32B if args.size == "32b" else SHAPES_7B
        bench_gemm([int(m) for m in args.m.split(",")], args.sweep, out, shapes)
    if "dgrad" in parts:
        bench_dgrad(out)
    if "rmsnorm" in parts:
        bench_rmsnorm(out)
    ws_m = [int(m) for m in args.ws_m.split(",")]
    for part in ("stamps", "ws", "ablate", "splits", "sampler", "attn"):
        if part in parts:
            sweep.ws(out, ws_m) if part == "ws" else getattr(sweep, part)(out)
    if "lora" in parts:
        from bench.lora_speed import lora
        lora(out, [int(m) for m in args.m.split(",") if int(m) <= 64] or [1], args.size)
    if args.json:
        fsutil.atomic_write_text(Path(args.json), json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
