# The two commands a newcomer needs: `make demo` and `make test`.
GO ?= go
PKGS := ./...

.PHONY: all build image demo test unit e2e lint fuzz bench golden setup clean

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
# real iptables (legacy and nft), real kube-apiserver and etcd. Needs root.
test: setup lint
	$(GO) test -race -count=1 -timeout 20m $(PKGS)

# The tests that need neither root nor the tools `make setup` installs:
# decisions, goldens, parsers, recorded commands. Any user; tests that need
# root are skipped here (and only here: `make test` runs them all).
UNIT_PKGS = $$($(GO) list ./... | grep -v '/test/')
unit:
	ISTIO_CNI_UNIT_ONLY=1 $(GO) test -race -count=1 $(UNIT_PKGS)

# The end-to-end suites: a simulated node in network namespaces, the real
# agent and plugin chain, a kube-apiserver, the chart, the image, a
# kubelet cluster. Needs root.
e2e: setup
	$(GO) test -race -count=1 -timeout 20m ./test/...

# Every Go fuzz test, FUZZTIME each (`make test` runs their seed corpora
# only). Found by name, so new ones need no change here.
FUZZTIME ?= 1m
fuzz:
	@set -e; for d in $$(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u); do \
		for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$d/*_test.go | cut -c6-); do \
			echo "== $$d $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$d; \
		done; \
	done

# gofmt, go vet and golangci-lint (.golangci.yml) at the version
# hack/install-lint.sh pins (built once by `make setup`, then cached).
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$$(hack/install-lint.sh) run $(PKGS)

# Per-pod latency of ADD and DEL through libcni, primary plugin alone vs
# the chain with istio-cni; prints p50/p99 and ratios.
bench: setup
	$(GO) run ./test/bench
	$(GO) run ./test/bench -cluster-pods 30

# Rewrites every golden file from the current code: every package whose
# tests compare with testdata goldens (found by name, so new ones need no
# change here). Review the diff before committing it.
golden:
	REFRESH_GOLDEN=true $(GO) test -count=1 $$(grep -rl --include='*_test.go' -e 'CompareGolden' -e 'REFRESH_GOLDEN' . | xargs -n1 dirname | sort -u)

clean:
	rm -rf bin
