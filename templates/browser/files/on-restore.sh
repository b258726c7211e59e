#!/bin/bash
# On-restore hook (clade runs on-restore hooks as part of hygiene, which a mark declared not clean skips).
# Seed 000's browser hygiene: siblings restored from one checkpoint share the browser's cookies, storage and V8
# random state. This asks the screen server (warm, already running) to clear the cookies and replace the page
# by the same page in a new browser context (a new renderer process, so a new V8 isolate seeded after the
# kernel's entropy was refreshed); its /ready answers 503 until that is done. bash, not python: this runs on
# every restore, and bash starts in milliseconds.
# A resume or a retake (CLADE_RESTORE=continue) is the same session going on, not a sibling: it keeps its page
# and cookies.
set -eu
[ "${CLADE_RESTORE:-sibling}" = continue ] && exit 0
exec 3<>/dev/tcp/127.0.0.1/9000
printf 'POST /hygiene HTTP/1.0\r\nContent-Length: 0\r\n\r\n' >&3
read -r _ status _ <&3
[ "$status" = 202 ] || { echo "screen server refused the browser hygiene: HTTP $status" >&2; exit 1; }
