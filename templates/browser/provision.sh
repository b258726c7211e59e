#!/bin/sh
# Runs once inside the booted sandbox when its base is built: waits until the session is agent-ready (the
# screenshot differs from the blank desktop and the page has a title), which also warms the readiness check
# itself (python, ImageMagick) into the base. Generous deadline: under TCG (vm backend) Chromium takes minutes.
set -eu
for i in $(seq 1 600); do
  if python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:9000/ready", timeout=60)' 2>/dev/null; then
    exit 0
  fi
  sleep 1
done
echo "the browser session did not become agent-ready in 10 minutes; see /var/log/clade/*.log" >&2
for f in /var/log/clade/*.log; do echo "== $f" >&2; tail -5 "$f" >&2; done
exit 1
