#!/usr/bin/env bash
# The testbed pilot: every candidate task's model pretrained and gated, one GPU a candidate.
#
#   experiments/pilot_candidates.sh pretrain OUT   # pretrain.py + pilot.py's static gate (~8 min)
#   experiments/pilot_candidates.sh rl OUT         # bf16 + LoRA RL, 300 steps at three learning
#                                                  # rates, then pilot.py with the RL gate (~8 min)
#
# Candidates (name, pretrain.py flags, held-out task): Countdown with 3, 4 and 5 numbers, and star
# graphs of 5 arms. Each runs on GPU i of CUDA_VISIBLE_DEVICES (4 GPUs: one each; fewer: they
# share). Writes OUT/<name>/ (the model), OUT/<name>.log, OUT/<name>-pilot.json and, for rl,
# OUT/<name>-rl/ (the ablation folder of the bf16 arm). Rerunning skips what is finished.
# EXTRA_PRETRAIN, EXTRA_PILOT and EXTRA_RL add flags to pretrain.py, pilot.py and the RL runs (a
# CPU smoke test shrinks everything with them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
phase=${1:?pretrain or rl}
out=${2:?an output folder}
mkdir -p "$out"
names=(cd3 cd4 cd5 sg5)
flags=("--preset countdown --count 3" "--preset countdown --count 4"
       "--preset countdown --count 5" "--preset stargraph --degree 5")
tasks=(countdown3 countdown countdown5 stargraph)
gpus=$($PY -c "import torch; print(max(1, torch.cuda.device_count()))")
# the RL flags every candidate shares: the ablation's (README, "Does quantization noise help?")
RL=(--algo dapo --steps 300 --prompts-per-step 8 --group-size 8 --max-new-tokens 64
    --lora-rank 8 --lora-alpha 16 --format-weight 0 --eval-every 50 --save-every 100
    --eval-limit 256)

one() {                                   # one candidate on one GPU
  local i=$1 name=${names[$1]} task=${tasks[$1]}
  export CUDA_VISIBLE_DEVICES=$((i % gpus))
  if [ "$phase" = pretrain ]; then
    [ -f "$out/$name/recipe.json" ] || $PY pretrain.py ${flags[$i]} --out "$out/$name" \
      ${EXTRA_PRETRAIN:-}
    $PY experiments/pilot.py --model "$out/$name" --task "${task}_test" \
      --out "$out/$name-pilot.json" ${EXTRA_PILOT:-}
  else
    $PY experiments/qerl_ablation.py --out "$out/$name-rl" --arms bf16 --seeds 0 \
      --lrs 1e-4,3e-4,1e-3 --procs-per-gpu 3 --pass-k-n 8 --entropy-samples 4 \
      --model "$out/$name" --task "$task" --eval-task "${task}_test" "${RL[@]}" ${EXTRA_RL:-}
    $PY experiments/pilot.py --model "$out/$name" --task "${task}_test" \
      --static-from "$out/$name-pilot.json" --out "$out/$name-pilot.json" \
      --runs "$out/$name-rl"/runs/*
  fi
}

start=$(date +%s)
for i in "${!names[@]}"; do
  one "$i" > "$out/${names[$i]}-$phase.log" 2>&1 &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
echo "phase $phase: $(( $(date +%s) - start )) s on $gpus GPU(s), exit $status"
for name in "${names[@]}"; do
  echo "== $name"; grep -E "^(PASS|FAIL)" "$out/$name-$phase.log" || tail -3 "$out/$name-$phase.log"
done
exit $status
