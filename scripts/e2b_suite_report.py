"""The table of scripts/e2b-suite.sh: by file, how many tests E2B's suite has, how many pass with no server at
all, and of those that reach a server, how many pass, fail or are skipped (with the reason) against clade.

usage: e2b_suite_report.py PHASE1.json PHASE2.json SKIPS.json BACKEND SDK_VERSION"""

import collections
import json
import sys

phase1 = json.load(open(sys.argv[1]))
phase2 = json.load(open(sys.argv[2]))
skips = json.load(open(sys.argv[3]))
backend = sys.argv[4]
sdk = sys.argv[5]


def file_of(nodeid):
    return nodeid.split("::")[0]


rows = collections.defaultdict(lambda: collections.Counter())
alone = []
for n, (o, reached) in phase1.items():
    f = file_of(n)
    rows[f]["collected"] += 1
    if o == "passed":
        rows[f]["no server"] += 1
    elif n.endswith("::(collection)"):
        rows[f]["collection error"] += 1
    elif not reached:
        rows[f]["alone"] += 1
        alone.append(n)
failed = []
for n, (o, _) in phase2.items():
    if n.endswith("::(collection)"):
        continue  # counted in phase 1 as a file that does not import
    f = file_of(n)
    rows[f][o] += 1
    if o == "failed":
        failed.append(n)

total = collections.Counter()
for c in rows.values():
    total.update(c)
reach = total["passed"] + total["failed"]
print(f"## E2B's suite against clade ({backend}, e2b=={sdk})\n")
print(f"{total['collected']} tests collected; {total['no server']} pass with no server (unit tests, mocks); "
      f"{total['alone']} fail with no server at all (they test another SDK version's internals); "
      f"{total['collection error']} files do not import with this SDK version; of the tests that reach clade, "
      f"{total['skipped']} are skipped with a reason and **{total['passed']} of {reach} pass "
      f"({100.0 * total['passed'] / max(reach, 1):.1f}%)**, {total['failed']} fail.\n")
print("| file | collected | pass, no server | fail, no server | passed | failed | skipped |")
print("|---|---|---|---|---|---|---|")
for f in sorted(rows):
    c = rows[f]
    if c["passed"] + c["failed"] + c["skipped"] + c["alone"] == 0 and not c["collection error"]:
        continue
    note = " (does not import)" if c["collection error"] else ""
    print(f"| `{f}`{note} | {c['collected']} | {c['no server']} | {c['alone']} | {c['passed']} | {c['failed']} | "
          f"{c['skipped']} |")
print(f"| **all** | {total['collected']} | {total['no server']} | {total['alone']} | {total['passed']} | "
      f"{total['failed']} | {total['skipped']} |\n")
print("Failed:\n")
for n in sorted(failed):
    print(f"- `{n}`")
print("\nFail with no server at all (not run against clade):\n")
for n in sorted(alone):
    print(f"- `{n}`")
print("\nSkipped:\n")
for prefix, reason in skips.items():
    n = sum(1 for k, (o, _) in phase2.items() if k.startswith(prefix) and o == "skipped")
    if n:
        print(f"- `{prefix}` ({n}): {reason}")
