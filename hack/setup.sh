#!/usr/bin/env bash
# Installs everything the tests, the demo and the benchmark need on a fresh
# Debian machine, and downloads everything they will build from, so that
# nothing needs the network once they run in namespaces without an uplink:
#   - Debian packages (apt-get): iptables, nftables, iproute2, the CNI
#     reference plugins, etcd, util-linux, busybox, containerd (with runc);
#   - the Go modules of this repository (go mod download);
#   - the Debian packages that go into the agent's image (hack/image-debs.sh);
#   - kube-apiserver, kubelet and kube-controller-manager built from the Go
#     module proxy (hack/build-kube.sh), cached by version.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(iptables nftables iproute2 containernetworking-plugins etcd-server util-linux busybox-static containerd dpkg)
missing=()
for p in "${pkgs[@]}"; do
  # Not `dpkg -s`: it succeeds for a removed package whose config files are left.
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
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
go mod download
hack/install-lint.sh >/dev/null
hack/image-debs.sh >/dev/null
hack/build-kube.sh kube-apiserver kubelet kube-controller-manager
