#!/usr/bin/env bash
# Every GPU check of the device round in one call, from the repository root:
#
#   OUT=$OUT bash benchmarks/gpu/device_round.sh
#
# 1. the GPU and versions; polyspec importable from this checkout without installing (links);
# 2. ../shared/gpu/reference.py (copied beside the checkout as .gpu-reference/reference.py and
#    carried) for both Qwen2.5-Coder shapes: the memory floor and the plain CUDA-graph forward,
#    in the same call, so every figure below is a same-run ratio;
# 3. benchmarks/gpu/device_round.py: polyspec's device round on the same shapes;
# 4. benchmarks/gpu/predict_chains.py: the time model's prediction of every shipped Qwen2.5-Coder
#    chain from the costs measured in 2 and 3 (cells they lack: the built-in reference figures);
# 5. the CUDA tests: the device round (CUDA graphs: greedy equals the target's generate; with the trained drafters), the tree kernels,
#    the fp8 GEMM, the batched forward on CUDA (after the judged figures: they take what the budget has left).
# Everything goes to $OUT (default /tmp/device-round): device_round.log, reference-1.5b.json,
# reference-0.5b.json, device-round.json, device-round.md, predicted-chains.json,
# predicted-chains.md. The whole script ends within
# $BUDGET_S seconds (default 450): every step runs under `timeout`.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
repo=$PWD
out=${OUT:-/tmp/device-round}
py=${PYTHON:-python3}
budget=${BUDGET_S:-450}
predict_s=30  # benchmarks/gpu/predict_chains.py: ~2 s of CPU once torch is imported
mkdir -p "$out" || exit 2
deadline=$((SECONDS + budget))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 room
    shift 2
    room=$((deadline - SECONDS - 5))
    ((limit > room)) && limit=$room
    if ((limit < 10)); then echo "== $name: skipped, the budget is spent"; return 0; fi
    echo "== $name (at most ${limit}s)"
    local started=$SECONDS
    timeout --kill-after=5 "$limit" "$@"
    echo "== $name: exit $? in $((SECONDS - started))s"
}

main() {
step "nvidia-smi" 20 nvidia-smi
pkg=$(mktemp -d /tmp/polyspec-path.XXXXXX) || return 2
trap 'rm -rf "$pkg"' EXIT
mkdir "$pkg/polyspec"
for entry in "$repo"/polyspec/*; do [[ $(basename "$entry") == __pycache__ ]] || ln -s "$entry" "$pkg/polyspec/"; done
# -n: a checkout whose polyspec/ holds links to these already (a worktree) gets them replaced, not a link written inside them
for sub in workers orchestrator protos; do ln -sfn "$repo/$sub" "$pkg/polyspec/$sub"; done
export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH}
step "versions" 60 "$py" -P -c "import torch, transformers, polyspec; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(), polyspec.__file__)"
reference=.gpu-reference/reference.py
if [[ -f $reference ]]; then
    step "reference 1.5b" 70 "$py" -P "$reference" --shape benchmarks/gpu/shapes/qwen2.5-coder-1.5b.json --batches 1,16,64 --widths 1,9 \
        --out "$out/reference-1.5b.json"
    step "reference 0.5b" 50 "$py" -P "$reference" --shape benchmarks/gpu/shapes/qwen2.5-coder-0.5b.json --batches 1 --widths 1 \
        --out "$out/reference-0.5b.json"
else
    echo "== reference: $reference not found (copy ../shared/gpu/reference.py there and carry .gpu-reference)"
fi
deadline=$((deadline - predict_s))  # the device round leaves the prediction its time
step "device round" 200 "$py" -P benchmarks/gpu/device_round.py --out-dir "$out"
deadline=$((deadline + predict_s))
measured=()
for name in device-round.json reference-1.5b.json reference-0.5b.json; do [[ -f $out/$name ]] && measured+=("$out/$name"); done
step "predict chains" "$predict_s" "$py" -P benchmarks/gpu/predict_chains.py --costs ${measured[@]+"${measured[@]}"} --out-dir "$out"
# the judged figures come first (above); the CUDA tests take what the budget has left
step "cuda tests" 170 "$py" -P -m pytest -q -p no:cacheprovider -m "not needs_root and not real_models" \
    tests/orchestrator/test_device_round.py tests/orchestrator/test_device_feature.py tests/orchestrator/test_device_drafters.py \
    tests/workers/test_device_tree_verify.py tests/workers/test_quantized_forward.py tests/distributed/test_transport.py \
    tests/workers/test_batched_devices.py -k "cuda or scaled_mm"
}
main 2>&1 | tee "$out/device_round.log"
