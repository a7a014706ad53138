#!/usr/bin/env bash
# Train the demo family's drafters on one GPU, all five runs side by side (the target is
# 8.7M parameters: each run uses a sliver of the card, so they share it):
#   feature head with FSPAD's loss, the same with the plain EAGLE loss (the ablation, same
#   budget), and the early-exit adapter over the target's first 1, 2 and 3 layers.
# Usage: benchmarks/gpu/train_drafters.sh WORK OUT MINUTES
#   WORK holds the tokenized corpus (WORK/corpus, built by any `polyspec train-draft` run,
#   so the split is the one the CPU benchmarks hold out) and the resumable checkpoints;
#   OUT receives one drafter folder per run and its log.
set -uo pipefail
work=${1:?WORK}; out=${2:?OUT}; minutes=${3:-5}
target=models/stdlib/target
common=(--target "$target" --work "$work" --device cuda --report-prompts 0 --batch 32 --context 256 --minutes "$minutes")
mkdir -p "$out"
python3 -m polyspec train-draft "${common[@]}" --kind feature --loss fspad --steps 6000 --out "$out/feature" >"$out/feature.log" 2>&1 &
python3 -m polyspec train-draft "${common[@]}" --kind feature --loss eagle --steps 6000 --out "$out/feature-eagle" >"$out/feature-eagle.log" 2>&1 &
for L in 1 2 3; do
    python3 -m polyspec train-draft "${common[@]}" --kind early-exit --layers "$L" --lr 0.002 --steps 6000 --out "$out/early-exit-L$L" >"$out/early-exit-L$L.log" 2>&1 &
done
rc=0
for job in $(jobs -p); do wait "$job" || rc=1; done
for log in "$out"/*.log; do echo "== $log"; tr '\r' '\n' <"$log" | grep -v '^$' | tail -4; done
exit $rc
