#!/usr/bin/env bash
# Builds the node agent's image without a container engine, as a
# docker-archive tarball: the agent (entry point), the plugin in
# /opt/cni/bin, the validation and diagnostics commands, Debian's iptables
# with its libraries (the agent programs and repairs pods with it in
# iptables mode), and a static busybox, whose nsenter writes the owner
# rules of user-namespaced pods.
# The image also carries the tag with Istio's variant suffixes
# (-distroless, -debug): one image, so values that set a variant (Istio's
# ambient profiles set distroless) find it.
# Usage: hack/build-image.sh [OUT.tar] [REPO:TAG]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/install-cni.tar}
tag=${2:-istio-cni-go/install-cni:dev}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
mkdir -p "$rootfs/usr/local/bin" "$rootfs/opt/cni/bin" "$rootfs/tmp" "$(dirname "$out")"
chmod 1777 "$rootfs/tmp"
for cmd in install-cni istio-cni-validate istio-cni-diag; do
  CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$rootfs/usr/local/bin/$cmd" "./cmd/$cmd"
done
for cmd in istio-cni istio-cni-fallback; do
  CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$rootfs/opt/cni/bin/$cmd" "./cmd/$cmd"
done

# Inside a test node (no uplink) the packages must already be there: the
# tests set ISTIO_CNI_OFFLINE=1 and `make setup` fetched them.
debs=$(hack/image-debs.sh ${ISTIO_CNI_OFFLINE:+--offline})
for deb in $debs; do
  dpkg-deb -x "$deb" "$rootfs"
done
go run ./hack/imagepack -rootfs "$rootfs" -tag "$tag,$tag-distroless,$tag-debug" -entrypoint install-cni -out "$out"
echo "$out"
