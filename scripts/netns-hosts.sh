#!/usr/bin/env bash
# Hosts in network namespaces, for the tcp fabric across "hosts" on one machine (as root).
#
#   scripts/netns-hosts.sh up PREFIX N [NET]   namespaces PREFIX0 .. PREFIX<N-1> at NET.1 ..
#                                              NET.N, and PREFIXsw holding the bridge at NET.254
#                                              (where ZooKeeper runs); NET defaults to 10.77.0
#   scripts/netns-hosts.sh down PREFIX N       removes them (their veth pairs go with them)
#   scripts/netns-hosts.sh partition PREFIX M [NET]
#                                              host M drops every packet to and from the other
#                                              hosts (nftables); it still reaches NET.254
#   scripts/netns-hosts.sh heal PREFIX M       and takes them again
#
# Each host joins the bridge by a veth pair created straight into the namespaces, so nothing is
# added to the root namespace and no traffic leaves the namespaces made here. Installs iproute2
# and nftables from Debian's packages when missing.
set -euo pipefail

need() {
  local missing=()
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v nft >/dev/null 2>&1 || missing+=(nftables)
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "== installing ${missing[*]} from Debian's packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

usage() {
  sed -n '2,15p' "$0" >&2
  exit 2
}

[ $# -ge 3 ] || usage
cmd=$1 prefix=$2 n=$3
case "$prefix" in
  *[!a-zA-Z0-9_-]* | "") echo "bad prefix $prefix" >&2; exit 2 ;;
esac

case "$cmd" in
  up)
    need
    net=${4:-10.77.0}
    sw="${prefix}sw"
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" addr add "$net.254/24" dev br0
    ip -n "$sw" link set br0 up
    for m in $(seq 0 $((n - 1))); do
      host="$prefix$m"
      ip netns add "$host"
      ip -n "$host" link set lo up
      ip link add eth0 netns "$host" type veth peer name "h$m" netns "$sw"
      ip -n "$sw" link set "h$m" master br0
      ip -n "$sw" link set "h$m" up
      ip -n "$host" addr add "$net.$((m + 1))/24" dev eth0
      ip -n "$host" link set eth0 up
    done
    ;;
  down)
    for m in $(seq 0 $((n - 1))); do
      ip netns del "$prefix$m" 2>/dev/null || true
    done
    ip netns del "${prefix}sw" 2>/dev/null || true
    ;;
  partition)
    need
    sw=${4:-10.77.0}.254
    ip netns exec "$prefix$n" nft -f - <<NFT
table inet farm_partition {
  chain input {
    type filter hook input priority 0; policy accept;
    iifname "eth0" ip saddr != $sw drop;
  }
  chain output {
    type filter hook output priority 0; policy accept;
    oifname "eth0" ip daddr != $sw drop;
  }
}
NFT
    ;;
  heal)
    ip netns exec "$prefix$n" nft delete table inet farm_partition
    ;;
  *) usage ;;
esac
