#!/bin/sh
# Chromium on the Xvfb display with the page loaded; CDP on 127.0.0.1:9222 (the title comes from there).
# The flags keep it from reaching for the network (there is none) and from needing a GPU or a sandbox, and
# keep its process tree small (GPU in the browser process, no spare renderer): every process and page is
# memory a mark stores and a restore maps back. No zygote: with it, a control message (passed file
# descriptors) stays queued on a zygote socket and CRIU 4.2 refuses the dump ("Control messages in queue,
# not supported"), every time here.
export DISPLAY=:99 DBUS_SESSION_BUS_ADDRESS=unix:path=/run/dbus/session HOME=/root
rm -rf /tmp/chromium-profile
exec chromium --no-sandbox --disable-gpu --disable-quic --no-first-run --no-default-browser-check \
  --disable-background-networking --disable-component-update --disable-sync --disable-dev-shm-usage \
  --disable-features=Translate,MediaRouter,SpareRendererForSitePerProcess --password-store=basic \
  --no-zygote --in-process-gpu --disable-breakpad --disable-crash-reporter \
  --user-data-dir=/tmp/chromium-profile --remote-debugging-address=127.0.0.1 --remote-debugging-port=9222 \
  --window-position=0,0 --window-size=1280,800 --start-maximized \
  file:///srv/browser/page.html
