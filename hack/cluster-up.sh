#!/usr/bin/env bash
# Brings up the single-node test cluster for a person (see test/clusterup);
# pass -chart to install the chart with the project's image too.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/setup.sh
exec go run ./test/clusterup "$@"
