#!/usr/bin/env bash
# Builds golangci-lint at the pinned version from the Go module proxy and
# caches it outside the work tree (like the kube binaries), so `make lint`
# needs no network once `make setup` has run. Prints the binary's path.
set -euo pipefail
GOLANGCI_LINT_VERSION=${GOLANGCI_LINT_VERSION:-v2.15.0}
cache="${LINT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-go/lint}/$GOLANGCI_LINT_VERSION-$(go env GOVERSION)"
bin="$cache/golangci-lint"
if [ ! -x "$bin" ]; then
  echo "building golangci-lint $GOLANGCI_LINT_VERSION (about two minutes, cached afterwards)" >&2
  mkdir -p "$cache"
  # Its own module cache: the project's may be a throwaway one (CI).
  GOMODCACHE="$cache/mod" GOFLAGS=-modcacherw GOBIN="$cache/tmp" CGO_ENABLED=0 \
    go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$GOLANGCI_LINT_VERSION" >"$cache/build.log" 2>&1 \
    || { cat "$cache/build.log" >&2; exit 1; }
  mv "$cache/tmp/golangci-lint" "$bin"
  rm -rf "$cache/tmp" "$cache/mod"
fi
echo "$bin"
