#!/usr/bin/env bash
# Installs what the tests, the demo and the benchmark need on a fresh
# Debian machine: the Debian packages below and a kube-apiserver built from
# the Go module proxy (cached in .cache/, so only the first run is slow).
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(iptables nftables iproute2 containernetworking-plugins etcd-server util-linux busybox-static containerd dpkg)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: root is needed to install: ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
hack/build-kube.sh kube-apiserver kubelet kube-controller-manager
