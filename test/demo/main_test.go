package main

import (
	"os"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

func TestMain(m *testing.M) {
	testenv.RunHelperIfRequested()
	testenv.EnterNodeNamespace()
	os.Exit(m.Run())
}

// TestDemo runs the README's first command in the test suite, so the demo
// keeps doing what it says.
func TestDemo(t *testing.T) {
	if err := run(t.Context()); err != nil {
		t.Fatal(err)
	}
}
