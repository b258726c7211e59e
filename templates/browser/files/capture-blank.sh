#!/bin/sh
# The blank desktop (Xvfb + openbox, before Chromium): the reference the readiness check compares against.
set -eu
mkdir -p /run/clade-browser
sleep 0.3
DISPLAY=:99 import -window root /run/clade-browser/blank.tmp.png
mv /run/clade-browser/blank.tmp.png /run/clade-browser/blank.png
