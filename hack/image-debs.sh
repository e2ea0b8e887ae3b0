#!/usr/bin/env bash
# Downloads the Debian packages that go into the agent's image (Debian's
# iptables with its libraries, and a static busybox for nsenter) into
# $DEB_CACHE_DIR, and prints the path of each (the newest version held). `make setup` runs it, so that
# nothing needs the network once tests run in namespaces without an uplink;
# hack/build-image.sh runs it too, for a person building the image alone.
# Usage: hack/image-debs.sh [--offline]   (--offline: fail instead of downloading)
set -euo pipefail
debs="${DEB_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-go/debs}"
pkgs=(iptables libip4tc2 libip6tc2 libxtables12 libnetfilter-conntrack3 libnfnetlink0 libnftnl11 libmnl0 libc6 libgcc-s1 gcc-12-base netbase busybox-static)
mkdir -p "$debs"
missing=()
for p in "${pkgs[@]}"; do
  compgen -G "$debs/${p}_*.deb" >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${1:-}" = --offline ]; then
    echo "image-debs: ${missing[*]} not in $debs; run 'make setup' (it needs the network) first" >&2
    exit 1
  fi
  echo "image-debs: downloading ${missing[*]} into $debs" >&2
  (cd "$debs" && { apt-get download "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get download "${missing[@]}" >/dev/null; }; })
fi
for p in "${pkgs[@]}"; do
  ls "$debs/${p}"_*.deb | sort -V | tail -n 1
done
