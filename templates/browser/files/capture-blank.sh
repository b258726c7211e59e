#!/bin/sh
# The blank desktop (Xvfb + openbox, before Chromium): the reference the readiness check compares against, a
# copy of Xvfb's framebuffer file (XWD format, `Xvfb -fbdir`). Both live in the overlay's /tmp, not on a
# tmpfs of the sandbox: CRIU stores a tmpfs as a gzipped tar on every mark and unpacks it on every restore.
set -eu
sleep 0.1
cp /tmp/clade-browser/Xvfb_screen0 /tmp/clade-browser/blank.xwd.tmp
mv /tmp/clade-browser/blank.xwd.tmp /tmp/clade-browser/blank.xwd
