package cniserver

// BenchInFreshNS and BenchNamespace serve the package's external
// benchmarks.
var (
	BenchInFreshNS = benchInFreshNS
	BenchNamespace = benchNamespace
)
