package cniserver

// BenchInFreshNS serves the package's external benchmarks.
var BenchInFreshNS = benchInFreshNS
