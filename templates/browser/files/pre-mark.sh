#!/bin/bash
# Pre-mark hook (clade runs /etc/clade/pre-mark.d/* just before a mark, with CLADE_MARK_CLEAN). Before a clean
# mark, the screen server opens the window the restores' browser hygiene will load the page in (POST /slot,
# see screen-server.py): the hygiene then navigates a ready window instead of creating a browser context and
# a window. A mark not declared clean gets no hygiene: nothing to prepare.
set -eu
[ "${CLADE_MARK_CLEAN:-1}" = 1 ] || exit 0
exec 3<>/dev/tcp/127.0.0.1/9000
printf 'POST /slot HTTP/1.0\r\nContent-Length: 0\r\n\r\n' >&3
read -r _ status _ <&3
[ "$status" = 200 ] || { echo "screen server could not prepare the hygiene's window: HTTP $status" >&2; exit 1; }
