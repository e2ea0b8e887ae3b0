# The two commands a newcomer needs: `make demo` and `make test`.
GO ?= go
PKGS := ./...

.PHONY: all build image demo test lint fuzz bench golden setup clean

all: build

# Static binaries, as the image ships them.
build:
	for c in istio-cni istio-cni-fallback install-cni istio-cni-validate istio-cni-diag; do \
		CGO_ENABLED=0 $(GO) build -trimpath -ldflags="-s -w" -o bin/$$c ./cmd/$$c || exit 1; done

setup:
	hack/setup.sh

# The node agent's image as a docker-archive tarball, built with no
# container engine (load it with `ctr images import` or `docker load`).
image:
	hack/build-image.sh out/install-cni.tar

# Runs a simulated pod through the real plugin chain and shows where its
# traffic goes.
demo: setup
	$(GO) run ./test/demo

# Every test, as CI runs them: lint, unit, golden, real namespaces,
# real iptables (legacy and nft), real kube-apiserver and etcd.
test: setup lint
	$(GO) test -race -count=1 -timeout 20m $(PKGS)

# Every Go fuzz test, FUZZTIME each (`make test` runs their seed corpora
# only). Found by name, so new ones need no change here.
FUZZTIME ?= 1m
fuzz:
	@set -e; for d in $$(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u); do \
		for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$d/*_test.go | cut -c6-); do \
			echo "== $$d $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$d; \
		done; \
	done

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

# Per-pod latency of ADD and DEL through libcni, primary plugin alone vs
# the chain with istio-cni; prints p50/p99 and ratios.
bench: setup
	$(GO) run ./test/bench
	$(GO) run ./test/bench -cluster-pods 30

# Rewrites every golden file from the current code (the rule sets, the
# nftables translation, merged CNI configs, the rendered chart).
golden:
	REFRESH_GOLDEN=true $(GO) test -count=1 ./internal/ruleset/... ./internal/nftables/... ./internal/install/... ./test/chart/...

clean:
	rm -rf bin
