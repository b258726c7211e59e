#!/bin/sh
# Runs once inside the booted sandbox when its base is built: checks the session is agent-ready.
set -eu
for i in $(seq 1 300); do
  if python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:9000/ready", timeout=5)' 2>/dev/null; then
    exit 0
  fi
  sleep 0.2
done
echo "the browser session did not become agent-ready in 60 s" >&2
exit 1
