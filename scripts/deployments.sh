#!/usr/bin/env bash
# Runs the same TATP and TPC-C workloads on the three deployments in one go, alternating them
# round by round: the in-process cluster (the `tatp` and `tpcc` benchmark binaries), three
# machine processes over `shm`, and three over `tcp` on loopback (`farm-node local tatp|tpcc`).
# Prints each run's throughput and latency, then per workload the medians and each
# multi-process median as a ratio to the in-process one. Absolute figures differ two-fold
# between machines; quote the ratios, which come from one run of this script.
#
#   scripts/with-zookeeper.sh scripts/deployments.sh [--rounds 2] [--seconds 5]
#       [--subscribers 100000] [--warehouses 3] [--workloads tatp,tpcc] [--in-flight 64]
#       [--tpcc-in-flight 4] [--kill-after 2] [--lease-ms 20]
#
# With --kill-after S, each round then runs TATP once more per deployment with machine 2
# failing S seconds in (in one process: killed; machine processes: killed, and stopped with
# SIGSTOP), all with --lease-ms leases, and prints the time from its suspicion to 80% of the
# throughput before, and how many live machines were suspected (false suspicions), with the
# medians and the sum at the end. The default lease, 20 ms, is the shortest these runs held
# on a 2-core machine without a false suspicion: at 10 ms (FaRM's, §6.4) all three processes
# once stalled 35 ms together while loading and the CM suspected both others
# (docs/REPORT-multiprocess.md). `farm-node` itself keeps 100 ms by default.
#
# Shape: 3 machines x 2 workers, 3-way replication. Client threads: the in-process cluster
# runs 2 (one per worker: a client keeps a worker thread of every machine), each machine
# process runs 1. TATP keeps the same transactions in flight in every deployment: each machine
# process's client thread --in-flight (default 64, 192 in all; `farm-node`'s own default over
# `tcp`, where more in flight keeps gaining, while `shm` and one process run as fast at 16 as
# at 64: docs/REPORT-multiprocess.md), the in-process cluster's two threads 3/2 as many each
# (96 each, 192 in all). TPC-C likewise with --tpcc-in-flight per
# machine process (default 4, 12 in all) and 3/2 as many per in-process thread (6 each, 12 in
# all). Needs ZooKeeper at $ZK_CONNECT
# (scripts/with-zookeeper.sh sets it) and release builds:
#
#   cargo build --release -p farm-benchmarks -p farm-node
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=2 seconds=5 subscribers=100000 warehouses=3 workloads=tatp,tpcc in_flight=64 tpcc_in_flight=4
kill_after= lease_ms=20
while [ $# -gt 0 ]; do
  case "$1" in
    --kill-after) kill_after=$2; shift 2 ;;
    --lease-ms) lease_ms=$2; shift 2 ;;
    --in-flight) in_flight=$2; shift 2 ;;
    --tpcc-in-flight) tpcc_in_flight=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --subscribers) subscribers=$2; shift 2 ;;
    --warehouses) warehouses=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
: "${ZK_CONNECT:?run under scripts/with-zookeeper.sh, or set ZK_CONNECT to a ZooKeeper}"
bin=target/release
for b in tatp tpcc farm-node; do
  [ -x "$bin/$b" ] || { echo "$bin/$b is missing: cargo build --release -p farm-benchmarks -p farm-node" >&2; exit 1; }
done
work=$(mktemp -d "${TMPDIR:-/tmp}/farm-deployments.XXXXXX")
# The machine processes' NVRAM files go to memory (/dev/shm), as the in-process cluster's
# regions are memory: on a disk-backed directory the kernel writes the shared mappings back to
# the disk while the run measures (FARM_NVRAM_DIR names another place).
nvram_root=${FARM_NVRAM_DIR:-/dev/shm}
[ -d "$nvram_root" ] && [ -w "$nvram_root" ] || nvram_root=$work
nvram=$(mktemp -d "$nvram_root/farm-deployments.XXXXXX")
trap 'rm -rf "$work" "$nvram"' EXIT
results=$work/results   # workload deployment per_second p50_us p99_us
: > "$results"

# The median of the numbers in a space-separated string (plain awk: no asort).
MEDIAN='
  function median(s,   a, n, i, j, t) {
    n = split(s, a, " ")
    for (i = 2; i <= n; i++) { t = a[i] + 0; for (j = i - 1; j >= 1 && a[j] + 0 > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }'

# `<N> transactions in <S> s: <X> per second; latency p50 <A> us, p99 <B> us` (in-process)
in_process() {
  local workload=$1 out=$work/out
  case $workload in
    tatp) "$bin/tatp" --subscribers "$subscribers" --seconds "$seconds" --clients 2 \
            --in-flight $((in_flight * 3 / 2)) > "$out" 2>&1 ;;
    tpcc) "$bin/tpcc" --warehouses "$warehouses" --seconds "$seconds" --clients 2 \
            --in-flight $((tpcc_in_flight * 3 / 2)) > "$out" 2>&1 ;;
  esac || { cat "$out" >&2; exit 1; }
  awk -v w="$workload" '/ per second; latency p50 / {
      for (i = 1; i <= NF; i++) { if ($i == "second;") x = $(i-2); if ($i == "p50") a = $(i+1); if ($i == "p99") b = $(i+1) }
      sub(",", "", a); print w, "in-process", x, a, b }' "$out" | tee -a "$results"
}

# `total: <X> transactions/s` and per machine `latency p50 <A> us p99 <B> us` (machine
# processes): the median machine's latencies.
processes() {
  local workload=$1 fabric=$2 out=$work/out
  local size=(--subscribers "$subscribers" --in-flight "$in_flight")
  [ "$workload" = tpcc ] && size=(--warehouses "$warehouses" --in-flight "$tpcc_in_flight")
  "$bin/farm-node" local "$workload" --cluster "deploy-$fabric" --dir "$nvram/$fabric" \
    --zookeeper "$ZK_CONNECT" --fabric "$fabric" --seconds "$seconds" "${size[@]}" > "$out" 2>&1 \
    || { cat "$out" >&2; exit 1; }
  awk -v w="$workload" -v d="$fabric" "$MEDIAN"'
    / latency p50 / { for (i = 1; i <= NF; i++) { if ($i == "p50") a = a " " $(i+1); if ($i == "p99") b = b " " $(i+1) } }
    /^  total: / { x = $2 }
    END { print w, d, x, median(a), median(b) }' "$out" | tee -a "$results"
}

# A TATP run in which machine 2 fails `kill_after` seconds in, `how` being `kill` or `stop`:
# `<deployment> <how> <suspected after ms> <suspicion to 80% ms> <false suspicions>` ("-" where
# never).
failure() {
  local deployment=$1 how=$2 out=$work/out
  if [ "$deployment" = in-process ]; then
    "$bin/tatp" --subscribers "$subscribers" --seconds "$seconds" --clients 2 \
      --in-flight $((in_flight * 3 / 2)) --kill "2@$kill_after" --lease-ms "$lease_ms" > "$out" 2>&1
  else
    local stop=(); [ "$how" = stop ] && stop=(--stop)
    "$bin/farm-node" local tatp --cluster "fail-$deployment" --dir "$nvram/$deployment" \
      --zookeeper "$ZK_CONNECT" --fabric "$deployment" --seconds "$seconds" \
      --subscribers "$subscribers" --in-flight "$in_flight" --kill-after "$kill_after" "${stop[@]}" \
      --lease-ms "$lease_ms" > "$out" 2>&1
  fi || { cat "$out" >&2; exit 1; }
  awk -v d="$deployment" -v h="$how" 'BEGIN { s = "-"; b = "-" }
    /suspected after / {
      for (i = 1; i <= NF; i++) {
        if ($i == "after" && $(i-1) == "suspected") s = $(i+1)
        if ($i == "of" && $(i-1) == "80%") b = $(i+3)
      }
      if (s !~ /^[0-9.]+$/) s = "-"; if (b !~ /^[0-9.]+$/) b = "-"
    }
    /^suspicions of live machines: / { f = $5 == "none" ? 0 : gsub(/ at -?[0-9.]+ s/, "") }
    END { print d, h, s, b, f == "" ? "-" : f }' "$out" | tee -a "$work/failures"
}

echo "workload deployment transactions/s p50_us p99_us"
for round in $(seq "$rounds"); do
  for workload in ${workloads//,/ }; do
    in_process "$workload"
    processes "$workload" shm
    processes "$workload" tcp
  done
done

if [ -n "$kill_after" ]; then
  echo
  echo "deployment failure suspected_after_ms suspicion_to_80%_ms false_suspicions (TATP, machine 2 at $kill_after s, $lease_ms ms leases)"
  : > "$work/failures"
  for round in $(seq "$rounds"); do
    failure in-process kill
    for fabric in shm tcp; do
      failure "$fabric" kill
      failure "$fabric" stop
    done
  done
fi

echo
echo "medians over $rounds rounds, ratios to the in-process median:"
awk "$MEDIAN"'
  { k = $1 " " $2; v[k] = v[k] " " $3; p50[k] = p50[k] " " $4; p99[k] = p99[k] " " $5; seen[$1] = 1 }
  END {
    for (w in seen) {
      base = median(v[w " in-process"])
      for (d = 1; d <= 3; d++) {
        dep = d == 1 ? "in-process" : d == 2 ? "shm" : "tcp"; k = w " " dep
        if (!(k in v)) continue
        m = median(v[k])
        printf "%-5s %-10s %12.0f/s  p50 %8.1f us  p99 %9.1f us  %.3fx\n", w, dep, m, median(p50[k]), median(p99[k]), m / base
      }
    }
  }' "$results"

if [ -n "$kill_after" ]; then
  echo
  echo "failures, medians over $rounds rounds:"
  awk "$MEDIAN"'
    { k = $1 " " $2; if ($3 != "-") s[k] = s[k] " " $3; if ($4 != "-") b[k] = b[k] " " $4; n[k]++; if ($5 != "-") f[k] += $5; else f[k] = f[k] "" }
    END { for (k in n) printf "%-15s suspected after %6.1f ms, back to 80%% %6.1f ms after, %s false suspicions (%d runs)\n", k, median(s[k]), median(b[k]), f[k] == "" ? "-" : f[k], n[k] }' \
    "$work/failures" | sort
fi
