#!/usr/bin/env bash
# E2B's own Python SDK test suite against clade, run unchanged (docs/e2b.md, "E2B's suite").
#
#   ./x e2b-suite E2B_CHECKOUT [--backend ct|vm] [--sdk VERSION] [--workers N] [--timeout S] [--out DIR]
#                              [--phase1 PHASE1.json]   (reuse a first phase of the same checkout and SDK)
#
# E2B_CHECKOUT is a clone of github.com/e2b-dev/E2B at the tag to test (its packages/python-sdk/tests are
# copied, never edited). Two phases:
#   1. the whole suite in a network namespace with only loopback and no E2B_* settings: a test needs a server
#      when it fails there trying E2B's own (*.e2b.app); the rest pass (unit tests, mocks) or fail on this
#      SDK version's internals with no server at all; nothing can leave the machine;
#   2. everything else against a `clade serve` of $CLADE_HOME (its E2B faces on loopback ports), except the
#      tests scripts/e2b_suite_skips.json names with the reason (the public internet, E2B's build service).
# The table by file goes to DIR/table.md (default $CLADE_HOME/e2b-suite/last).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
export CLADE_HOME=${CLADE_HOME:-/var/lib/clade}

checkout=""; backend=ct; sdk=2.63.0; workers=4; timeout=60; out="$CLADE_HOME/e2b-suite/last"; phase1=""
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) backend=$2; shift 2 ;;
    --sdk) sdk=$2; shift 2 ;;
    --phase1) phase1=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -*) echo "e2b-suite: unknown option $1" >&2; exit 2 ;;
    *) checkout=$1; shift ;;
  esac
done
if [ -z "$checkout" ] || [ ! -d "$checkout/packages/python-sdk/tests" ]; then
  echo "e2b-suite: give a clone of github.com/e2b-dev/E2B (git clone --depth 1 -b '@e2b/python-sdk@2.45.1' ...)" >&2
  exit 2
fi
case "$backend" in ct|vm) ;; *) echo "e2b-suite: --backend ct or vm" >&2; exit 2 ;; esac

clade=${CLADE_BIN:-$repo/target/release/clade}
[ -x "$clade" ] || clade="$repo/target/debug/clade"
[ -x "$clade" ] || { echo "e2b-suite: build clade first (cargo build --release -p clade -p clade-agent)" >&2; exit 2; }

# The SDK (default: the version ./x setup installs; the suite's own tag's version for its unit tests' mocks),
# and the suite's own test dependencies (its pyproject's dev group).
venv="$CLADE_HOME/e2b-suite/venv-$sdk"
if [ ! -x "$venv/bin/pytest" ]; then
  echo "e2b-suite: making $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "e2b==$sdk" "pytest>=9.0.3,<10" "pytest-xdist>=3.3.1,<4" "python-dotenv>=1,<2" \
    "pytest-dotenv>=0.5.2,<0.6" "pytest-asyncio>=1.3.0,<2" "pytest-timeout>=2.4.0,<3"
fi

work=$(mktemp -d)
serve_pid=""
cleanup() {
  [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
cp -a "$checkout/packages/python-sdk" "$work/sdk"
mkdir -p "$out"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
pytest_args=(-p e2b_suite_plugin -p no:cacheprovider -q -n "$workers" --timeout "$timeout" --continue-on-collection-errors)

if [ -n "$phase1" ]; then
  echo "e2b-suite: phase 1 from $phase1"
  [ "$phase1" -ef "$out/phase1.json" ] || cp "$phase1" "$out/phase1.json"
else
echo "e2b-suite: phase 1, no server (a network namespace with loopback only)"
(cd "$work/sdk" && env -u E2B_API_URL -u E2B_SANDBOX_URL -u E2B_DOMAIN -u E2B_DEBUG \
  E2B_API_KEY="e2b_$(printf '0%.0s' {1..40})" CLADE_SUITE_OUT="$out/phase1.json" \
  unshare -n sh -c 'ip link set lo up && exec "$0" "$@"' "$venv/bin/pytest" "${pytest_args[@]}" tests \
  > "$out/phase1.log" 2>&1) || true
fi
"$venv/bin/python" - "$out/phase1.json" "$work/need-server" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
# A test needs a server when, with none, it failed trying E2B's own (*.e2b.app). One that failed otherwise
# fails with no server at all: it tests this SDK version's internals, not a server.
need = [n for n, (o, reached) in r.items() if o == "failed" and reached]
alone = sum(1 for o, reached in r.values() if o != "passed" and not reached)
open(sys.argv[2], "w").write("\n".join(need) + "\n")
print(f"e2b-suite: {len(r)} tests: {len(r) - len(need) - alone} pass without a server, {alone} fail without one "
      f"(SDK internals), {len(need)} need a server")
PY

echo "e2b-suite: phase 2, against clade serve ($backend)"
key=$("$clade" e2b key create | tr -d '[:space:]')
CLADE_E2B_BACKEND=$backend "$clade" serve --listen 127.0.0.1:0 --e2b-api 127.0.0.1:0 --e2b-sandbox 127.0.0.1:0 \
  > "$out/serve.log" 2>&1 &
serve_pid=$!
api=""; envd=""
for _ in $(seq 1 100); do
  line=$(grep -m1 "E2B API on" "$out/serve.log" || true)
  if [ -n "$line" ]; then
    api=$(echo "$line" | sed -E 's/.*E2B API on (http:[^,]*),.*/\1/')
    envd=$(echo "$line" | sed -E 's/.*envd on (http:[^ ]*).*/\1/')
    break
  fi
  kill -0 "$serve_pid" 2>/dev/null || { cat "$out/serve.log" >&2; exit 1; }
  sleep 0.2
done
[ -n "$api" ] || { echo "e2b-suite: clade serve did not start" >&2; cat "$out/serve.log" >&2; exit 1; }
(cd "$work/sdk" && env -u E2B_DOMAIN -u E2B_DEBUG E2B_API_KEY="$key" E2B_API_URL="$api" E2B_SANDBOX_URL="$envd" \
  CLADE_SUITE_OUT="$out/phase2.json" CLADE_SUITE_ONLY="$work/need-server" \
  CLADE_SUITE_SKIP="$here/e2b_suite_skips.json" \
  "$venv/bin/pytest" "${pytest_args[@]}" tests > "$out/phase2.log" 2>&1) || true

"$venv/bin/python" "$here/e2b_suite_report.py" "$out/phase1.json" "$out/phase2.json" "$here/e2b_suite_skips.json" \
  "$backend" "$sdk" > "$out/table.md"
cat "$out/table.md"
