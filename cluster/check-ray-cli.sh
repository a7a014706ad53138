#!/usr/bin/env bash
# A real Ray cluster from the `ray` CLI on this machine: a head and two worker nodes, each
# with one custom resource, then `polyspec batch` with runtime.backend: ray (each tier of the
# demo chain pinned to its own node), compared with the embedded mode's output, while the
# mid tier's raylet is killed mid-batch. Prints what it checks; exits non-zero on a mismatch.
#
#   cluster/check-ray-cli.sh [REQUESTS] [start]     (default 40 greedy requests x 48 tokens)
#
# With `start`, the small drafter's raylet is also killed while the chain is starting (as soon
# as a tier actor runs its constructor): the batch must start without it and lose nothing.
#
# Uses its own GCS port (6420) and temp dir, and stops only the processes it started
# (`ray stop` would stop every Ray process on the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-40}
START_FAULT=${2:-}
PORT=${RAY_CHECK_PORT:-6420}  # another port where another check may run
WORK=$(mktemp -d /tmp/polyspec-ray-cli.XXXXXX)
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
IP=$(python -c "import ray; print(ray.util.get_node_ip_address())")

raylet_of() {  # the raylet of this cluster's node with resource $1 (not another cluster's)
  pgrep -f "raylet.*$1" | while read -r pid; do tr '\0' ' ' < /proc/$pid/cmdline | grep -q "$IP:$PORT" && echo "$pid"; done | head -1
}

cleanup() {
  # Ray processes rename themselves (ray::DashboardAgent, ...) and a killed raylet leaves its
  # agents behind, so find this run's processes by what they hold open: logs under $WORK
  for fds in /proc/[0-9]*/fd; do
    pid=${fds#/proc/}; pid=${pid%/fd}
    [ "$pid" = $$ ] && continue
    if ls -l "$fds" 2>/dev/null | grep -q "$WORK/"; then kill -9 "$pid" 2>/dev/null || true; fi
  done
  for pid in $(pgrep -f "$WORK" || true) $(pgrep -f "gcs_server_port=$PORT" || true) $(pgrep -f "gcs-address=$IP:$PORT" || true); do
    kill -9 "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT

echo "== ray start: head (tier_target) + 2 workers (tier_mid, tier_small) on $IP:$PORT"
ray start --head --port=$PORT --num-cpus=1 --resources='{"tier_target": 1}' --include-dashboard=false \
  --temp-dir="$WORK/ray" --disable-usage-stats > "$WORK/head.log" 2>&1
ray start --address="$IP:$PORT" --num-cpus=1 --resources='{"tier_mid": 1}' > "$WORK/mid.log" 2>&1
ray start --address="$IP:$PORT" --num-cpus=1 --resources='{"tier_small": 1}' > "$WORK/small.log" 2>&1
ray status --address="$IP:$PORT" | sed -n '/Resources/,$p' | head -20

sed -e "s|address: auto|address: $IP:$PORT|" configs/demo-ray.yaml > "$WORK/chain.yaml"
sed -i "s|\.\./models|$PWD/models|g" "$WORK/chain.yaml"
python - "$REQUESTS" > "$WORK/requests.jsonl" <<'PY'
import json, sys
prompts = [r["prompt"][-400:] for r in map(json.loads, open("models/stdlib/prompts.jsonl")) if r.get("class") != "repetitive-code"]
for i in range(int(sys.argv[1])):
    print(json.dumps({"id": f"r{i}", "prompt": prompts[i % len(prompts)], "max_new_tokens": 48}))
PY

echo "== embedded reference: the same chain in one process (runtime.backend: local)"
sed -e 's/backend: ray/backend: local/' "$WORK/chain.yaml" > "$WORK/local.yaml"
polyspec batch -c "$WORK/local.yaml" -i "$WORK/requests.jsonl" -o "$WORK/embedded.jsonl"

echo "== polyspec batch on the cluster; the mid node's raylet is killed after 10 results"
STARTED=$(date +%s.%N)
polyspec batch -c "$WORK/chain.yaml" -i "$WORK/requests.jsonl" -o "$WORK/ray.jsonl" --stats "$WORK/stats.json" 2> >(tee "$WORK/batch.err" >&2) &
BATCH=$!
if [ "$START_FAULT" = start ]; then
  # a tier actor of this cluster (a child of one of its raylets) has begun its constructor
  RAYLETS=$(for r in tier_target tier_mid tier_small; do raylet_of $r; done | paste -sd,)
  until pgrep -P "$RAYLETS" -f "TierActor" > /dev/null; do sleep 0.1; kill -0 $BATCH 2>/dev/null || break; done
  RAYLET=$(raylet_of tier_small || true)
  echo "killing the small node's raylet while the chain starts (pid $RAYLET, $(echo "$(date +%s.%N) - $STARTED" | bc) s after launch)"
  kill -9 "$RAYLET"
  until [ -s "$WORK/ray.jsonl" ]; do sleep 0.2; kill -0 $BATCH 2>/dev/null || break; done
  echo "first result $(echo "$(date +%s.%N) - $STARTED" | bc) s after launch"
fi
while [ "$(wc -l < "$WORK/ray.jsonl" 2>/dev/null || echo 0)" -lt 10 ]; do sleep 0.5; kill -0 $BATCH 2>/dev/null || break; done
RAYLET=$(raylet_of tier_mid || true)
if [ -n "$RAYLET" ]; then echo "killing the mid node's raylet (pid $RAYLET)"; kill -9 "$RAYLET"; else echo "no mid raylet found"; fi
wait $BATCH

python - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
read = lambda name: {r["id"]: r for r in map(json.loads, open(f"{work}/{name}.jsonl"))}
embedded, distributed = read("embedded"), read("ray")
missing = sorted(set(embedded) - set(distributed))
differ = sorted(i for i in embedded if i in distributed and distributed[i].get("token_ids") != embedded[i]["token_ids"])
stats = json.load(open(f"{work}/stats.json"))
print(f"requests: {len(embedded)}, results: {len(distributed)}, missing: {missing}, differing from embedded: {differ}")
print(f"rounds on a shortened chain: {stats['degraded_rounds']}, target failovers: {stats['failovers']}, "
      f"{stats['tokens_per_s']} tok/s")
for tier in stats["tiers"]:
    print(f"  {tier['tier']}: up={tier['up']} {tier.get('sent', '')}")
for event in stats.get("tier_events", []):
    print(f"  at {event['at_s']} s: {event['tier']} {event['event']}: {event['reason']}")
sys.exit(1 if missing or differ else 0)
PY
echo "OK: every request finished, equal to the embedded output"
