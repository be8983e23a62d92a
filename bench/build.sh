#!/usr/bin/env bash
# Builds kiln and its unit-test binary for a GPU machine into .gpu/ (stripped, xz), as the other bench scripts expect them there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo build --release
tests=$(cargo test --release --no-run --message-format=json 2> /dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["bin"] and m["profile"]["test"]:
        print(m["executable"])')
strip -o .gpu/kiln target/release/kiln
strip -o .gpu/kiln-test "$tests"
xz -T0 -6 -f .gpu/kiln .gpu/kiln-test
ls -la .gpu
