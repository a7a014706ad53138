#!/usr/bin/env bash
# A real `ray up` on one machine: three "machines" on loopback addresses, each tier of the
# demo family on its own Ray node, `polyspec serve` on the head.
#
#   cluster/try-local.sh up       # sshd on 127.0.0.{1,2,3}:22, ray up, polyspec serve; prints the address
#   cluster/try-local.sh check    # the SDK against the server, compared with embedded mode; ray status
#   cluster/try-local.sh down     # stop everything it started (bounded), remove what it wrote
#   cluster/try-local.sh render OUT.yaml   # only write the rendered cluster YAML (used by the tests)
#
# What it does, so nothing is a surprise:
# - installs openssh-server and rsync with apt-get if they are missing (services are not
#   started by the install; a policy-rc.d is put in place only if none exists);
# - makes a throwaway SSH client key and host key under $POLYSPEC_TRY_LOCAL_DIR
#   (default /tmp/polyspec-try-local) and starts one sshd per node, bound to that node's
#   loopback address only (127.0.0.1, 127.0.0.2, 127.0.0.3, port 22), each in its own PID
#   namespace. The launcher assumes one node per machine: `ray stop` (which every start
#   command and `ray down` run) stops every Ray process it can see, so on one box a
#   worker's `ray stop` would stop the head. In a PID namespace a node sees only its own
#   processes, exactly as on separate machines, and the Ray commands stay the stock ones;
# - renders cluster/local.yaml for those addresses (the head carries tier_target, the
#   workers tier_mid and tier_small, matching configs/demo-ray.yaml) and runs `ray up -y`;
#   the head's autoscaler then brings up the two workers over SSH, as on real machines;
# - starts `polyspec serve -c configs/demo-ray.yaml` on the head (`ray exec`), waits for
#   its gRPC health check and prints the address.
# `ray up` copies the launcher key to ~/ray_bootstrap_key.pem and the config to
# ~/ray_bootstrap_config.yaml of the SSH user (the head is this machine); `down` removes them.
# Needs root (or sudo) for apt-get and for sshd on port 22.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${POLYSPEC_TRY_LOCAL_DIR:-/tmp/polyspec-try-local}
HEAD_IP=127.0.0.1
WORKER_IPS=(127.0.0.2 127.0.0.3)
NODE_IPS=("$HEAD_IP" "${WORKER_IPS[@]}")
RAY_PORT=6379
SERVE_PORT=${POLYSPEC_TRY_LOCAL_PORT:-50051}
METRICS_PORT=${POLYSPEC_TRY_LOCAL_METRICS_PORT:-9464}
CONFIG=configs/demo-ray.yaml
CLUSTER_YAML=$STATE/local.yaml
WAIT_S=${POLYSPEC_TRY_LOCAL_WAIT_S:-600}
# the Python that has polyspec and Ray installed (POLYSPEC_PYTHON to choose one)
PYTHON=""
for candidate in ${POLYSPEC_PYTHON:-} python python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import polyspec.orchestrator.cli, ray' 2>/dev/null; then
        PYTHON=$("$candidate" -c 'import sys; print(sys.executable)')
        break
    fi
done
if [ -z "$PYTHON" ]; then
    echo "try-local: error: no Python here imports polyspec and ray; install them the README's way (python -m pip install \"torch==2.13.0\" -e \".[dev]\") or set POLYSPEC_PYTHON" >&2
    exit 1
fi
BIN=$(dirname "$PYTHON")          # where this Python's `ray` and `polyspec` live
export PATH="$BIN:$PATH"
SSH_USER=$(id -un)
# the cluster's own Ray token (see render); exported so `ray status` and `ray up` here use it
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$STATE/ray_auth_token"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo

say() { printf 'try-local: %s\n' "$*" >&2; }
die() { printf 'try-local: error: %s\n' "$*" >&2; exit 1; }

# ------------------------------------------------------------------------ packages

install_packages() {
    local missing=()
    [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
    command -v rsync >/dev/null || missing+=(rsync)
    if [ ${#missing[@]} -eq 0 ]; then return 0; fi
    command -v apt-get >/dev/null || die "needs ${missing[*]} and there is no apt-get; install them, then run this again"
    say "installing ${missing[*]} (apt-get)"
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if [ ! -e "$policy" ]; then   # keep the install from starting a system-wide sshd on 0.0.0.0:22
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod 755 "$policy" && created_policy=1
    fi
    local ok=0
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >"$STATE/apt.log" 2>&1 && ok=1
    if [ $ok -eq 0 ]; then
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get update -q >>"$STATE/apt.log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$STATE/apt.log" 2>&1 && ok=1
    fi
    if [ $created_policy -eq 1 ]; then $SUDO rm -f "$policy"; fi
    [ $ok -eq 1 ] || die "could not install ${missing[*]} with apt-get (no network or package cache?); see $STATE/apt.log"
}

# ------------------------------------------------------------------------ sshd per node

start_sshd() {   # one sshd per loopback address, each in its own PID namespace
    [ -f "$STATE/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C polyspec-try-local -f "$STATE/id_ed25519"
    [ -f "$STATE/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N "" -f "$STATE/ssh_host_ed25519_key"
    cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
    chmod 600 "$STATE/authorized_keys"
    $SUDO mkdir -p /run/sshd
    local ip
    for ip in "${NODE_IPS[@]}"; do
        if [ -f "$STATE/ns-$ip.pid" ] && kill -0 "$(cat "$STATE/ns-$ip.pid")" 2>/dev/null; then
            continue
        fi
        if port_busy "$ip" 22; then
            die "something already listens on $ip:22 (a system sshd on 0.0.0.0?); stop it or bind it to another address"
        fi
        cat >"$STATE/sshd-$ip.conf" <<EOF
ListenAddress $ip:22
HostKey $STATE/ssh_host_ed25519_key
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
MaxStartups 200
MaxSessions 200
Subsystem sftp internal-sftp
EOF
        # --kill-child: when this unshare dies, the namespace's init (sshd) gets SIGKILL and the
        # kernel ends every process of the namespace, so `down` leaves nothing behind.
        $SUDO setsid unshare --pid --fork --mount-proc --kill-child \
            /usr/sbin/sshd -D -f "$STATE/sshd-$ip.conf" -E "$STATE/sshd-$ip.log" </dev/null >/dev/null 2>&1 &
        echo $! >"$STATE/ns-$ip.pid"
    done
    for ip in "${NODE_IPS[@]}"; do
        local tries=0
        until ssh -q -i "$STATE/id_ed25519" -o BatchMode=yes -o StrictHostKeyChecking=no \
            -o UserKnownHostsFile=/dev/null -o ConnectTimeout=3 "$SSH_USER@$ip" true 2>/dev/null; do
            tries=$((tries + 1))
            [ $tries -lt 20 ] || die "sshd on $ip:22 does not accept the key; see $STATE/sshd-$ip.log"
            sleep 0.5
        done
    done
    say "sshd up on ${NODE_IPS[*]} (port 22, loopback only)"
}

stop_sshd() {
    local ip pid
    for ip in "${NODE_IPS[@]}"; do
        [ -f "$STATE/ns-$ip.pid" ] || continue
        pid=$(cat "$STATE/ns-$ip.pid")
        # SIGKILL the namespace's unshare: its child (pid 1 inside) dies, and with it every
        # process of the node (raylet, workers, polyspec serve).
        $SUDO kill -KILL "$pid" 2>/dev/null || true
        rm -f "$STATE/ns-$ip.pid"
    done
}

# ------------------------------------------------------------------------ cluster YAML

render() {   # render cluster/local.yaml for the loopback nodes into $1
    "$PYTHON" - "$REPO/cluster/local.yaml" "$1" "$HEAD_IP" "${WORKER_IPS[0]}" "${WORKER_IPS[1]}" \
        "$SSH_USER" "$STATE/id_ed25519" "$BIN" "$REPO" "$RAY_PORT" "$RAY_AUTH_TOKEN_PATH" <<'EOF'
import sys
import yaml

template, out, head_ip, mid_ip, small_ip, user, key, bin_dir, repo, port, token = sys.argv[1:]
config = yaml.safe_load(open(template))
# every Ray process and client of this cluster uses its own token (Ray turns token auth on
# for a head that finds ~/.ray/auth_token; workers and clients must then agree explicitly)
path = f"export PATH={bin_dir}:$PATH RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token}"
config["cluster_name"] = "polyspec-try-local"
config["provider"] = {"type": "local", "head_ip": head_ip, "worker_ips": [mid_ip, small_ip]}
config["auth"] = {"ssh_user": user, "ssh_private_key": key}
# the nodes share this machine's filesystem: the checkout is already everywhere
config["file_mounts"] = {}
config["setup_commands"] = [
    f"{path}; cd {repo} && (python -c 'import polyspec.orchestrator.cli, ray' 2>/dev/null"
    f" || python -m pip install 'torch==2.13.0' -e '.[dev]')"
]
# 100 MB object store per node: the demo moves token ids only; no usage stats (loopback only)
small = "--object-store-memory=100000000 --disable-usage-stats"
ulimit = "ulimit -n 65536 2>/dev/null;"  # raise it where allowed (a container may forbid it)


def retried(start: str) -> str:
    """`ray start` fails if its raylet has not registered with the GCS within Ray's fixed 30 s,
    which happens on a loaded 2-core box; the autoscaler never retries a node whose start
    failed, so retry here (its `ray stop` only sees this node's PID namespace)."""
    return f"for attempt in 1 2 3; do {start} && break; [ $attempt = 3 ] && exit 1; ray stop; sleep 5; done"


config["head_start_ray_commands"] = [
    f"{path}; ray stop",
    f"{path}; {ulimit} "
    + retried(
        f"RAY_enable_autoscaler_v2=0 ray start --head --port={port} --node-ip-address={head_ip}"
        f" --autoscaling-config=~/ray_bootstrap_config.yaml --resources='{{\"tier_target\": 1}}' {small}"
    ),
]
config["worker_start_ray_commands"] = [
    f"{path}; ray stop",
    f"{path}; NODE_IP=$(echo $SSH_CONNECTION | cut -d' ' -f3);"
    f" case $NODE_IP in"
    f" {mid_ip}) RESOURCES='{{\"tier_mid\": 1}}';;"
    f" {small_ip}) RESOURCES='{{\"tier_small\": 1}}';;"
    f" *) RESOURCES='{{}}';;"
    f" esac;"
    f" {ulimit} "
    + retried(f"ray start --address=$RAY_HEAD_IP:{port} --node-ip-address=$NODE_IP --resources=\"$RESOURCES\" {small}"),
]
header = "# Rendered by cluster/try-local.sh from cluster/local.yaml: three nodes on loopback.\n"
with open(out, "w") as handle:
    handle.write(header + yaml.safe_dump(config, sort_keys=False, width=1000))
EOF
}

# ------------------------------------------------------------------------ helpers

ray_status() { ray status "$@" --address "$HEAD_IP:$RAY_PORT" 2>/dev/null; }

wait_for_workers() {
    local deadline=$((SECONDS + WAIT_S)) status
    say "waiting for the autoscaler to start the workers on ${WORKER_IPS[*]}"
    while :; do
        status=$(ray_status || true)
        if grep -q "tier_mid" <<<"$status" && grep -q "tier_small" <<<"$status" && grep -q "tier_target" <<<"$status"; then
            return 0
        fi
        [ $SECONDS -lt $deadline ] || die "the workers did not join within ${WAIT_S}s; see /tmp/ray/session_latest/logs/monitor.* and 'ray status'"
        sleep 3
    done
}

health() {   # exit 0 when the server's gRPC health check says SERVING
    "$PYTHON" - "$1" <<'EOF'
import sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

try:
    with grpc.insecure_channel(sys.argv[1]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
except grpc.RpcError:
    sys.exit(1)
EOF
}

start_serve() {
    local address="$HEAD_IP:$SERVE_PORT"
    if health "$address"; then
        die "something already serves on $address; set POLYSPEC_TRY_LOCAL_PORT or stop it"
    fi
    say "starting polyspec serve -c $CONFIG on the head"
    rm -f "$STATE/serve.log"
    timeout --kill-after=10 "$WAIT_S" ray exec --no-config-cache "$CLUSTER_YAML" \
        "export PATH=$BIN:\$PATH RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH RAY_ADDRESS=$HEAD_IP:$RAY_PORT; cd $REPO && setsid nohup polyspec serve -c $CONFIG --host $HEAD_IP --port $SERVE_PORT --metrics-port $METRICS_PORT --state-dir $STATE/serve-state >$STATE/serve.log 2>&1 </dev/null & sleep 1" >"$STATE/serve-exec.log" 2>&1
    local deadline=$((SECONDS + WAIT_S))
    until health "$address"; do
        if grep -q "polyspec: error\|Traceback" "$STATE/serve.log" 2>/dev/null; then
            tail -n 20 "$STATE/serve.log" >&2
            die "polyspec serve failed on the head; the log is $STATE/serve.log"
        fi
        [ $SECONDS -lt $deadline ] || die "polyspec serve was not healthy within ${WAIT_S}s; see $STATE/serve.log"
        sleep 2
    done
}

# ------------------------------------------------------------------------ commands

port_busy() {   # is something listening on $1:$2?
    "$PYTHON" - "$1" "$2" <<'EOF'
import socket, sys
with socket.socket() as s:
    s.settimeout(1)
    sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)
EOF
}

cmd_up() {
    if [ -f "$STATE/ns-$HEAD_IP.pid" ] && health "$HEAD_IP:$SERVE_PORT"; then
        say "already up"
        echo "$HEAD_IP:$SERVE_PORT"
        return 0
    fi
    local port
    for port in "$RAY_PORT" "$SERVE_PORT" "$METRICS_PORT"; do
        if port_busy "$HEAD_IP" "$port"; then
            die "port $port is taken on $HEAD_IP (another Ray cluster or server?); stop it, or '$0 down' if it is an earlier try-local"
        fi
    done
    mkdir -p "$STATE"
    chmod 700 "$STATE"
    install_packages
    if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
        (umask 077 && "$PYTHON" -c 'import secrets, sys; sys.stdout.write(secrets.token_hex(32))' >"$RAY_AUTH_TOKEN_PATH")
    fi
    start_sshd
    render "$CLUSTER_YAML"
    say "ray up (head $HEAD_IP, workers ${WORKER_IPS[*]}); log: $STATE/ray-up.log"
    touch "$STATE/.up-started"
    for file in ray_bootstrap_key.pem ray_bootstrap_config.yaml; do   # remember what ray up will overwrite
        if [ -e ~/"$file" ] && [ ! -e "$STATE/saved-$file" ]; then cp -p ~/"$file" "$STATE/saved-$file"; fi
    done
    if ! timeout --kill-after=10 "$WAIT_S" ray up -y --no-config-cache "$CLUSTER_YAML" >"$STATE/ray-up.log" 2>&1; then
        tail -n 30 "$STATE/ray-up.log" >&2
        die "ray up failed; the full log is $STATE/ray-up.log ('$0 down' cleans up)"
    fi
    wait_for_workers
    start_serve
    ray_status -v >&2 || true
    say "polyspec serves the demo chain on $HEAD_IP:$SERVE_PORT (metrics: http://$HEAD_IP:$METRICS_PORT/metrics)"
    say "try: python -c \"from polyspec.client import Client; print(Client('$HEAD_IP:$SERVE_PORT').generate('def fibonacci(n):', max_new_tokens=32)['text'])\""
    say "check against embedded mode: $0 check; stop everything: $0 down"
    echo "$HEAD_IP:$SERVE_PORT"
}

cmd_check() {   # the SDK against the server, compared with the same chain embedded; ray status
    health "$HEAD_IP:$SERVE_PORT" || die "nothing healthy on $HEAD_IP:$SERVE_PORT; run '$0 up' first"
    (cd "$REPO" && "$PYTHON" - "$HEAD_IP:$SERVE_PORT" "$CONFIG" <<'EOF'
import dataclasses
import json
import sys

from polyspec.client import Client
from polyspec.orchestrator.config import RuntimeConfig, load_config
from polyspec.orchestrator.engine import Engine

address, config_path = sys.argv[1:]
prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):"]
with Client(address) as client:
    served = [client.generate(prompt, max_new_tokens=48, temperature=0.0) for prompt in prompts]
config = load_config(config_path)
embedded_engine = Engine(dataclasses.replace(config, runtime=RuntimeConfig(backend="local")))
embedded = [embedded_engine.generate(embedded_engine.parse_request({"prompt": p, "max_new_tokens": 48})) for p in prompts]
same = all(s["token_ids"] == e["token_ids"] for s, e in zip(served, embedded))
for prompt, result in zip(prompts, served):
    print(json.dumps({"prompt": prompt, "text": result["text"]}))
print(f"served output {'equals' if same else 'DIFFERS FROM'} embedded mode on {len(prompts)} greedy prompts", file=sys.stderr)
sys.exit(0 if same else 1)
EOF
    )
    ray_status -v   # per node: each tier's resource in use on its own node
}

cmd_down() {
    # No `ray down`: it runs `ray stop` over SSH in a login shell, where `ray` is not on the
    # PATH unless this Python's bin folder is, and then retries for many minutes. Every
    # process of the cluster (raylets, GCS, autoscaler, workers, polyspec serve) lives in
    # one of the nodes' PID namespaces, so killing the namespaces ends all of them at once.
    if [ -f "$STATE/ns-$HEAD_IP.pid" ]; then say "stopping the nodes"; fi
    stop_sshd
    # a `ray up` / `ray exec` of an interrupted `up` runs outside the namespaces: its command line names $STATE/
    pkill -KILL -f -- "$STATE/" 2>/dev/null || true
    # what `ray up` wrote outside $STATE: the bootstrap files (restored if they existed before)
    # and the on-premises provider's node state
    if [ -f "$STATE/.up-started" ]; then
        for file in ray_bootstrap_key.pem ray_bootstrap_config.yaml; do
            if [ -e "$STATE/saved-$file" ]; then cp -p "$STATE/saved-$file" ~/"$file"; else rm -f ~/"$file"; fi
        done
    fi
    rm -f /tmp/ray/cluster-polyspec-try-local.state /tmp/ray/cluster-polyspec-try-local.lock
    local ip deadline=$((SECONDS + 30))   # the kernel reaps the namespaces' processes; wait for their ports
    for ip in "${NODE_IPS[@]}"; do
        while port_busy "$ip" 22 && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
    done
    while { port_busy "$HEAD_IP" "$SERVE_PORT" || port_busy "$HEAD_IP" "$RAY_PORT"; } && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
    rm -rf "$STATE"
    say "down: nothing of the try-local cluster is running"
}

case "${1:-}" in
    up) cmd_up ;;
    check) cmd_check ;;
    down) cmd_down ;;
    render)
        [ -n "${2:-}" ] || die "usage: $0 render OUT.yaml"
        mkdir -p "$STATE"
        render "$2"
        ;;
    *)
        echo "usage: $0 up | check | down | render OUT.yaml" >&2
        exit 2
        ;;
esac
