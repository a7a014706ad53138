#!/usr/bin/env bash
# The batched engine on a lent GPU, in one command from the repository root:
#
#   bash benchmarks/gpu/load_gpu.sh
#
# 1. prints the GPU (nvidia-smi) and the Python, torch and transformers versions;
# 2. makes `polyspec` importable from this checkout without installing anything (the lent
#    machine has no network): a folder of symbolic links laid out as the installed package,
#    first on PYTHONPATH;
# 3. runs the CUDA cases of tests/workers/test_batched_devices.py (the batched tier against
#    the one-request tier, and batched engines against the target's greedy output, in
#    float32, bfloat16 and float16) and the int4 loading test (skipped without bitsandbytes);
# 4. runs benchmarks/load.py --quick on configs/demo-gpu.yaml (or $LOAD_CONFIG), writing
#    $OUT/load-<gpu>.{json,md,png}; until it ends, load-<gpu>.partial.{json,md} hold the
#    cells done so far, so a run cut short keeps what it measured.
#
# Every step runs under `timeout`, so the whole script ends within $BUDGET_S seconds (420 by
# default). Everything it prints also goes to $OUT/load_gpu.log: four to six files in all.
# Environment: OUT (default /tmp/load-gpu), LOAD_CONFIG, BUDGET_S, PYTHON (default python3),
# LOAD_ARGS (extra arguments for load.py, e.g. "--concurrency 1,4 --temperatures 0"),
# TEST_SELECT (the tests' -k expression; a CPU try of this script: "cpu and bfloat16").
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
repo=$PWD
out=${OUT:-/tmp/load-gpu}
config=${LOAD_CONFIG:-configs/demo-gpu.yaml}
py=${PYTHON:-python3}
budget=${BUDGET_S:-420}
mkdir -p "$out" || exit 2
deadline=$((SECONDS + budget))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
status=()

left() { echo $((deadline - SECONDS)); }

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (less if the budget is running out)
step() {
    local name=$1 limit=$2
    shift 2
    local room=$(( $(left) - 5 ))
    ((limit > room)) && limit=$room
    if ((limit < 10)); then
        echo "== $name: skipped, the time budget is spent"
        status+=("$name: skipped")
        return 0
    fi
    echo "== $name (at most ${limit}s; $(left)s of the budget left)"
    local started=$SECONDS
    timeout --kill-after=5 "$limit" "$@"
    local rc=$?
    local verdict="ok"
    ((rc == 124 || rc == 137)) && verdict="TIMED OUT after ${limit}s" || { ((rc != 0)) && verdict="FAILED (exit $rc)"; }
    echo "== $name: $verdict in $((SECONDS - started))s"
    status+=("$name: $verdict")
}

main() {
echo "== load_gpu.sh at $(date -u +%FT%TZ) in $repo, budget ${budget}s, output $out"
step "nvidia-smi" 20 nvidia-smi
step "versions" 60 "$py" -c "import platform, torch, transformers
print('python', platform.python_version(), 'torch', torch.__version__, 'transformers', transformers.__version__)
print('cuda', torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else '-')"

# polyspec as setuptools installs it (pyproject's package-dir): polyspec/ plus workers/,
# orchestrator/ and protos/ as its subpackages, linked rather than copied
pkg=$(mktemp -d /tmp/polyspec-path.XXXXXX) || return 2
trap 'rm -rf "$pkg"' EXIT  # links only: the checkout is not touched
mkdir "$pkg/polyspec"
for entry in "$repo"/polyspec/*; do
    [[ $(basename "$entry") == __pycache__ ]] || ln -s "$entry" "$pkg/polyspec/"
done
for sub in workers orchestrator protos; do ln -s "$repo/$sub" "$pkg/polyspec/$sub"; done
export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH}
# -P: no current folder first on sys.path, where the checkout's own polyspec/ (without its
# subpackages) would hide the linked one (Python >= 3.11)
step "import polyspec" 60 "$py" -P -c "import polyspec, polyspec.orchestrator.engine, polyspec.workers.tiers.batched as b
assert polyspec.__file__.startswith('$pkg'), polyspec.__file__
print('polyspec from', polyspec.__file__)"

step "device tests" 120 "$py" -P -m pytest -q -p no:cacheprovider -rs -m "not needs_root and not real_models" \
    -k "${TEST_SELECT:-cuda or int4_loads_on_a_gpu}" tests/workers/test_batched_devices.py tests/deploy/test_int4.py

gpu=$(timeout 60 "$py" -c "import torch; n = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'
print(next((k for k in ('h100', 'h200') if k in n.lower()), 'gpu' if n != 'cpu' else 'cpu'))" 2>/dev/null || echo gpu)
# shellcheck disable=SC2086  # LOAD_ARGS is a list of arguments
step "load benchmark" 280 "$py" -P benchmarks/load.py --config "$config" --quick --out "$out/load-$gpu" ${LOAD_ARGS:-}
for table in "$out/load-$gpu.md" "$out/load-$gpu.partial.md"; do [[ -f $table ]] && cat "$table"; done

echo "== summary ($((SECONDS))s in all)"
printf '   %s\n' "${status[@]}"
ls -l "$out"
for s in "${status[@]}"; do [[ $s == *": ok" ]] || return 1; done
return 0
}

# a pipeline, not a process substitution: the script ends only once the log has every line
main 2>&1 | tee -a "$out/load_gpu.log"
exit "${PIPESTATUS[0]}"
