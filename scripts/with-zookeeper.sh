#!/usr/bin/env bash
# Runs a command with a standalone ZooKeeper server on 127.0.0.1, exported as ZK_CONNECT, and
# stops the server afterwards. Installs Debian's ZooKeeper (and a Java runtime) when missing.
#
#   scripts/with-zookeeper.sh cargo test --workspace --release
#
# ZK_PORT picks the port (default: a free one from 21810 up) and ZK_ADDRESS the address it
# listens at (default 127.0.0.1; the netns test runs one on its namespaces' bridge). The
# server's data and log live in a temporary directory that is removed at exit, also when the
# script is terminated; its log is printed if it fails to start.
set -euo pipefail

jars=(zookeeper zookeeper-jute slf4j-api slf4j-simple metrics-core commons-cli commons-io
      netty-buffer netty-codec netty-common netty-handler netty-resolver netty-transport
      netty-transport-native-epoll netty-transport-native-unix-common)

missing=0
command -v java >/dev/null 2>&1 || missing=1
for j in "${jars[@]}"; do [ -f "/usr/share/java/$j.jar" ] || missing=1; done
if [ "$missing" = 1 ]; then
  echo "== installing ZooKeeper from Debian's packages" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends default-jre-headless libzookeeper-java \
    libslf4j-java >&2
fi
classpath=$(printf '/usr/share/java/%s.jar:' "${jars[@]}")

addr=${ZK_ADDRESS:-127.0.0.1}
port_free() { ! (exec 3<>"/dev/tcp/$addr/$1") 2>/dev/null; }
port=${ZK_PORT:-}
if [ -z "$port" ]; then
  for p in $(seq 21810 21900); do
    if port_free "$p"; then port=$p; break; fi
  done
fi
[ -n "$port" ] || { echo "no free port for ZooKeeper in 21810-21900" >&2; exit 1; }

# The server is for tests and development, its data thrown away at exit: it lives in memory
# (/dev/shm where there is one) and does not fsync (forceSync=no). On disk, behind the
# writeback of machines' NVRAM files (hundreds of MB each at a stop), its log writes and fsyncs
# stalled for seconds, and every session timed out.
dir=$(mktemp -d /dev/shm/farm-zk.XXXXXX 2>/dev/null || mktemp -d "${TMPDIR:-/tmp}/farm-zk.XXXXXX")
data=$dir/data
mkdir -p "$data"
cat > "$dir/zoo.cfg" <<CFG
tickTime=500
initLimit=10
syncLimit=5
dataDir=$data
clientPort=$port
clientPortAddress=$addr
admin.enableServer=false
4lw.commands.whitelist=ruok,srvr
forceSync=no
CFG
# Machine processes under test keep every core of a small host busy, and the kernel then left
# ZooKeeper seconds in the run queue at any nice value (a `ruok` took 3-4 s, once 32 s, and a
# reconfiguration, which stores the configuration, waited as long: docs/REPORT-multiprocess.md).
# Real-time round-robin at the lowest priority keeps it answering within milliseconds, as FaRM
# runs its lease manager at the highest priority (section 5.1). Where that is not permitted,
# ZooKeeper runs at normal priority.
realtime=()
if chrt -r 1 true 2>/dev/null; then realtime=(chrt -r 1); fi
"${realtime[@]}" java -cp "$classpath" org.apache.zookeeper.server.quorum.QuorumPeerMain \
  "$dir/zoo.cfg" > "$dir/server.log" 2>&1 &
zk_pid=$!
cleanup() {
  kill "$zk_pid" 2>/dev/null || true
  wait "$zk_pid" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

ruok() { (exec 3<>"/dev/tcp/$addr/$port" && printf ruok >&3 && timeout 2 cat <&3) 2>/dev/null; }
for _ in $(seq 1 120); do
  if [ "$(ruok || true)" = imok ]; then break; fi
  if ! kill -0 "$zk_pid" 2>/dev/null; then
    echo "ZooKeeper exited while starting; its log:" >&2
    cat "$dir/server.log" >&2
    exit 1
  fi
  sleep 0.5
done
if [ "$(ruok || true)" != imok ]; then
  echo "ZooKeeper did not answer ruok within 60 s; its log:" >&2
  cat "$dir/server.log" >&2
  exit 1
fi
export ZK_CONNECT="$addr:$port"
# For tests that start servers of their own (the 3-server ensemble test).
export ZK_CLASSPATH="$classpath"
echo "== ZooKeeper $ZK_CONNECT (pid $zk_pid)" >&2
"$@"
