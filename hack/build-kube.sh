#!/usr/bin/env bash
# Builds Kubernetes server binaries (kube-apiserver by default) from the Go module
# proxy and caches them under $KUBE_CACHE_DIR (default ~/.cache/istio-cni-go/kube)
# /<version>/, outside the work tree so fresh clones on the same machine reuse them.
# Usage: hack/build-kube.sh [binary...]
set -euo pipefail
# internal/testenv reads KUBE_VERSION too, with the same default: change both.
KUBE_VERSION=${KUBE_VERSION:-v1.34.4}
STAGING_VERSION=v0${KUBE_VERSION#v1}
cache="${KUBE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-go/kube}/$KUBE_VERSION"
mkdir -p "$cache"
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(kube-apiserver)
missing=()
for b in "${bins[@]}"; do [ -x "$cache/$b" ] || missing+=("$b"); done
[ ${#missing[@]} -gt 0 ] || exit 0

mod="$cache/mod"
mkdir -p "$mod"
staging=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
  cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
  cri-client csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms
  kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
  mount-utils pod-security-admission sample-apiserver sample-cli-plugin sample-controller)
{
  echo "module kubebuild"
  echo "go 1.24"
  echo "require k8s.io/kubernetes $KUBE_VERSION"
  for s in "${staging[@]}"; do echo "replace k8s.io/$s => k8s.io/$s $STAGING_VERSION"; done
} > "$mod/go.mod"
{
  printf 'package kubebuild\n\nimport (\n'
  for b in "${bins[@]}"; do printf '\t_ "k8s.io/kubernetes/cmd/%s/app"\n' "$b"; done
  printf ')\n'
} > "$mod/tools.go"
cd "$mod"
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=mod"
go mod tidy >/dev/null 2>&1 || go mod download
for b in "${missing[@]}"; do
  echo "building $b $KUBE_VERSION (a few minutes, cached afterwards)" >&2
  CGO_ENABLED=0 go build -trimpath -ldflags=-s -o "$cache/$b.tmp" "k8s.io/kubernetes/cmd/$b"
  mv "$cache/$b.tmp" "$cache/$b"
done
