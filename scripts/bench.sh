#!/usr/bin/env bash
# ./x bench [WHAT...] [--quick]: runs the bench binaries; results go to bench/out/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p bench/out
echo "./x bench: no benches are defined yet" >&2
