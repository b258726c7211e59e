#!/usr/bin/env bash
# ./x bench [WHAT...] [--quick]: run the benches, side by side with their peers in one run each; every bench
# prints JSON lines (one per figure, with its bar and PASS/FAIL computed from the samples) into bench/out/.
#   store  put/get vs b3sum/cp, dedup of a 1%-changed copy; synthetic, then real guest RAM when a vm base
#          left a RAM file                                          (crates/clade-bench/src/bin/store-bench.rs)
#   nbd    clade-nbd vs qemu-nbd: sequential, random 4 KiB, snapshot (crates/clade-bench/src/bin/nbd-bench.rs)
#   agent  hello, exec, file transfer vs host                        (crates/clade-bench/src/bin/agent-bench.rs)
#   template  a cold build of minimal vs a cache hit, its image's stored bytes vs its files
#                                                        (crates/clade-bench/src/bin/template-bench.rs)
#   vm     vm figures, incl. QEMU templating by hand                 (crates/clade-bench/src/vm.rs)
#   ct     ct figures: minimal rootfs and the browser template, vs plain CRIU by hand; the jail's cost
#                                                                     (crates/clade-bench/src/bin/ct-bench/)
#   browser  cold vs restored agent-ready, memory, pause with the browser template on ct, then vm (TCG: slow)
#                                                                     (crates/clade-bench/src/browser.rs)
#   fleet  the built-in fleet, keep-running vs suspend-idle, with the costs measured above (clade fleet simulate)
#   roam   suspend here, resume on a fresh home via Garage: fetched vs working set, resume there vs here, push vs boto3 (crates/clade-bench/src/roam.rs)
#   api    HTTP vs library exec, 32 clients on ct, restart            (crates/clade-bench/src/api.rs)
#   e2b    the E2B SDK's create-to-first-command vs the library, ct and vm (crates/clade-bench/src/e2b.rs)
#   k8s    containerd's CRI: a pod of the minimal and browser templates' images to its first ready probe, clade
#          from the base vs runc cold, and over `clade fork`              (crates/clade-bench/src/k8s.rs)
#   scale  many siblings on one host: bulk fork cold and from a pool, host memory per idle sibling (zygote vs
#          exec), a thousand idle siblings, kill of all, vm pool fork and 50 idle vm; needs no sandbox running (crates/clade-bench/src/scale/);
#          then the browser's mark pause with pre-dump / without, in a vm guest on Debian trixie's kernel (browser_predump)
# Then `clade-bench report` gathers bench/out into report.json and report.html (docs/report.md).
# Default: all. --quick: fewer samples and smaller images, no browser template (a CI-like check, minutes).
# `ct` and `browser` build the browser template (and `browser` its bases) first when missing: debootstrap
# and ~1 GB of packages from the Debian mirror the first time, with a progress line per step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
quick=0
what=()
for a in "$@"; do
  case "$a" in
    --quick) quick=1 ;;
    store|nbd|agent|template|vm|ct|browser|e2b|roam|fleet|api|scale|k8s) what+=("$a") ;;
    *) echo "./x bench: unknown bench '$a' (store, nbd, agent, template, vm, ct, browser, fleet, e2b, roam, api, scale, k8s; --quick)" >&2; exit 2 ;;
  esac
done
# store after browser: its second run takes the largest guest RAM file a vm base left (the browser's, 2 GiB).
[ ${#what[@]} -gt 0 ] || what=(nbd agent template vm ct browser store fleet roam api e2b k8s scale)
out=bench/out
mkdir -p "$out"
bin=target/release
run() { # name, command...
  local name=$1; shift
  echo "=== bench $name: $*" >&2
  local start=$(date +%s)
  if "$@" > "$out/$name.jsonl"; then
    echo "=== bench $name: done in $(( $(date +%s) - start )) s -> $out/$name.jsonl" >&2
  else
    echo "=== bench $name: FAILED (exit $?) after $(( $(date +%s) - start )) s; partial output in $out/$name.jsonl" >&2
    failed+=("$name")
  fi
}
failed=()
# The browser template built for one backend (cached after the first time); prints its record's path.
browser_template() { # backend
  echo "=== bench: browser template for $1 (built when missing; the first time downloads ~1 GB)" >&2
  "$bin/clade" template build templates/browser --backend "$1" --json |
    python3 -c 'import json, os, sys; r = json.load(sys.stdin)["record"]; print(os.path.join(os.path.dirname(r["rootfs"]), "template.json"))'
}
# The browser's own mark pause with pre-dump / without, in one sandbox (docs/scale.md): inside a vm guest on
# Debian's kernel, the only place these hosts track dirty pages (clade-vm's guest_ct_in_vm, which also runs the
# ct jail suite there), with the browser template's rootfs ($1) copied in. The guest boots Debian stable's
# (trixie's) kernel, fetched beside setup's by scripts/guest-kernel.sh: before Linux 6.7 (bookworm's 6.1) CRIU
# reads the page map of Chromium's three 1.3 TiB address-space reservations entry by entry, ~65 s of every
# freeze under TCG. Prints the figure's JSON line.
browser_predump() { # rootfs
  local jail pre line kernel
  scripts/static-agent.sh >&2
  kernel=$(scripts/guest-kernel.sh trixie) || return 1
  test_bin() { cargo test -p clade-ct --test "$1" --no-run --message-format=json 2>/dev/null |
    sed -n "s/.*\"executable\":\"\([^\"]*$1[^\"]*\)\".*/\1/p" | tail -n1; }
  jail=$(test_bin guest_jail); pre=$(test_bin guest_predump)
  line=$(CLADE_GUEST_KERNEL=$kernel CT_JAIL_TEST_BIN=$jail CT_PREDUMP_TEST_BIN=$pre CT_BROWSER_ROOTFS_HOST=$1 timeout 3600 \
    cargo test -p clade-vm --test guest_ct_in_vm -- --nocapture 2>&1 | tee /dev/stderr | grep 'browser-predump:' | tail -n1)
  [ -n "$line" ] || return 1
  python3 - "$line" <<'PY'
import json, re, sys
line = sys.argv[1]
full = [float(x) for x in re.search(r"full_ms=\[([^\]]*)\]", line).group(1).split(",")]
inc = [float(x) for x in re.search(r"predump_ms=\[([^\]]*)\]", line).group(1).split(",")]
ratio = sum(inc) / len(inc) / (sum(full) / len(full))
tracked = "tracked=true" in line
print(json.dumps({"name": "scale.ct.browser_mark_pause_predump_over_full", "value": ratio, "unit": "x",
                  "bar": "<= 0.5", "pass": tracked and ratio <= 0.5, "samples": [i / f for i, f in zip(inc, full)],
                  "detail": {"full_ms": full, "predump_ms": inc, "tracked": tracked,
                             "where": "ct in a clade vm guest (TCG) on Debian trixie's kernel, cgroup v2", "line": line}}))
PY
}
# The minimal template's bases on both backends (cached after the first build).
minimal_bases() {
  $bin/clade template build templates/minimal/template.toml >&2
  # By the spec's path, not the name: the newest template named `minimal` may be another build (a test's, ct
  # only) than the one just made.
  $bin/clade base build templates/minimal/template.toml --backend vm >&2
  $bin/clade base build templates/minimal/template.toml --backend ct >&2
}
for w in "${what[@]}"; do
  case "$w" in
    store) if [ $quick = 1 ]; then run store $bin/store-bench --size-mib 256; else run store $bin/store-bench; fi
      # The input the store's bars are meant for too: the largest guest RAM file a vm base left on this host's
      # RAM tmpfs.
      ram=$(ls -S "${CLADE_SHM:-/dev/shm/clade}"/ram/*.ram 2>/dev/null | head -n1 || true)
      if [ $quick = 1 ]; then echo "=== bench store-ram: skipped by --quick" >&2
      elif [ -z "$ram" ]; then echo "=== bench store-ram: skipped (no vm base RAM file yet: run ./x bench vm first)" >&2
      else run store-ram $bin/store-bench --image "$ram"; fi ;;
    nbd) if [ $quick = 1 ]; then run nbd $bin/nbd-bench --quick; else run nbd $bin/nbd-bench; fi ;;
    agent) run agent $bin/agent-bench --agent $bin/clade-agent ;;
    template) run template $bin/template-bench templates/minimal/template.toml ;;
    vm) if [ $quick = 1 ]; then run vm $bin/clade-bench vm --quick --out "$out/vm.json"; else run vm $bin/clade-bench vm --out "$out/vm.json"; fi ;;
    ct) if [ $quick = 1 ]; then run ct $bin/ct-bench --n 5 --mem-counts 1,2 --mark-gap-secs 10  # minimal only
        elif tpl=$(browser_template ct); then run ct $bin/ct-bench --n 20 --browser "$tpl"
        else echo "=== bench ct: FAILED to build the browser template" >&2; failed+=(ct); fi
        # The jail's cost: jail on / off side by side (docs/security.md).
        run ct-jail $bin/ct-bench --only jail --n $([ $quick = 1 ] && echo 3 || echo 10) ;;
    browser) if [ $quick = 1 ]; then
          echo "=== bench browser: skipped by --quick (the browser template is ~1 GB to build; run ./x bench browser)" >&2
        else
          run browser-ct $bin/clade-bench browser --backend ct --n 20 --mem-counts 1,4,8,12 --out "$out/browser-ct.json"
          # TCG: Chromium in a guest is slow (cold ~60 s, a restore with its browser hygiene ~23 s); 4 such guests
          # at once did not reach agent-ready in 300 s on 2 cores, so the vm slope is over 1 and 2 (docs/templates.md).
          run browser-vm $bin/clade-bench browser --backend vm --n 5 --mem-counts 1,2 --cold-mem-counts 1,2 --out "$out/browser-vm.json"
        fi ;;
    fleet) # costs from this run's vm/ct outputs or the ledger; measured on ct now when there are none
      run fleet sh -c "$bin/clade fleet simulate --figures 2>/dev/null || $bin/clade fleet simulate --measure --figures" ;;
    roam) r=$([ $quick = 1 ] && echo 1 || echo 3)
      minimal_bases
      run roam $bin/clade-bench roam --rounds $r --template templates/minimal/template.toml --out "$out/roam.json" ;;
    scale) minimal_bases
      if [ $quick = 1 ]; then run scale $bin/clade-bench scale --quick --out "$out/scale.json"; else run scale $bin/clade-bench scale --out "$out/scale.json"; fi
      if [ $quick = 1 ]; then echo "=== bench scale-predump: skipped by --quick" >&2
      elif t=$(browser_template ct); then run scale-predump browser_predump "$(dirname "$t")/rootfs"
      else echo "=== bench scale-predump: FAILED to build the browser template" >&2; failed+=(scale-predump); fi ;;
    api) if [ $quick = 1 ]; then run api $bin/clade-bench api --quick --out "$out/api.json"; else run api $bin/clade-bench api --out "$out/api.json"; fi ;;
    e2b) n=$([ $quick = 1 ] && echo 5 || echo 15)  # the e2b SDK comes from ./x setup
      minimal_bases
      run e2b-ct $bin/clade-bench e2b --backend ct --n $n --out "$out/e2b-ct.json"
      run e2b-vm $bin/clade-bench e2b --backend vm --n $n --out "$out/e2b-vm.json" ;;
    k8s) n=$([ $quick = 1 ] && echo 3 || echo 10)  # containerd and runc come from ./x setup
      minimal_bases
      run k8s-minimal $bin/clade-bench k8s --template minimal --n $n
      if [ $quick = 1 ]; then echo "=== bench k8s-browser: skipped by --quick" >&2
      elif browser_template ct >/dev/null; then run k8s-browser $bin/clade-bench k8s --template browser --n $n --bar 0.5
      else echo "=== bench k8s-browser: FAILED to build the browser template" >&2; failed+=(k8s-browser); fi ;;
  esac
done
# The report: every figure above (and any earlier run's left in $out) in report.json and report.html.
$bin/clade-bench report --dir "$out" || failed+=("report")
grep -h '"pass"' "$out"/*.jsonl 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try: f = json.loads(line)
    except ValueError: continue
    if "pass" in f and "name" in f:
        print(("PASS" if f["pass"] else "FAIL"), f["name"], "=", f.get("value"), f.get("unit", ""), "(bar", f.get("bar", "?") + ")")
' || true
[ ${#failed[@]} -eq 0 ] || { echo "./x bench: failed: ${failed[*]}" >&2; exit 1; }
