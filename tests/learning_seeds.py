"""How reliably the tiny-model RL run of tests/test_train.py::test_reward_rises learns, over \
several seeds.

    python tests/learning_seeds.py --seeds 4 --steps 30  # every algo, bf16 and NVFP4 + AQN
    python tests/learning_seeds.py --algos dapo --bases bf16 --seeds 2 --steps 20 --lr 0.01

Prints one line per run: sampled accuracy over the first and last 3 and 5 steps, greedy accuracy
before and after, and whether test_train.learned() accepts it. Any flag it does not know goes to
train.py. Runs on CPU or a GPU.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_train  # noqa: E402
import train  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algos", default="grpo,dapo,dr_grpo",
                    help="comma list of train.py --algo values")
    ap.add_argument("--bases", default="bf16,nvfp4",
                    help="comma list: bf16 (no AQN) and/or nvfp4 (with AQN, as the test)")
    ap.add_argument("--seeds", type=int, default=4, help="seeds 0 .. N-1")
    ap.add_argument("--steps", default=test_train.STEPS, help="RL steps per run")
    args, extra = ap.parse_known_args(argv)
    ok = total = 0
    for algo in args.algos.split(","):
        for base in args.bases.split(","):
            for seed in range(args.seeds):
                out = os.path.join(tempfile.mkdtemp(), "run")
                train.main(["--out", out, "--algo", algo, "--base", base,
                            "--steps", str(args.steps), "--seed", str(seed)]
                           + test_train.LEARN + test_train.base_args(base) + extra)
                rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
                acc = [r["accuracy"] for r in rows if "accuracy" in r]
                s, e, e0, e1 = test_train.learning(rows)  # 3-step windows, greedy before / after
                good = test_train.learned(rows)
                ok, total = ok + good, total + 1
                print(f"RESULT {algo} {base} seed {seed}: "
                      f"3-step {sum(acc[:3]) / 3:.3f} -> {sum(acc[-3:]) / 3:.3f}  "
                      f"3-step {s:.3f} -> {e:.3f}  greedy {e0:.2f} -> {e1:.2f}  learned {good}",
                      flush=True)
    print(f"learned in {ok} of {total} runs")


if __name__ == "__main__":
    main()
