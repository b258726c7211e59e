#!/bin/sh
# Runs once inside the booted sandbox when its base is built; the base is marked after it succeeds.
set -eu
python3 -c 'import sys; print("python", sys.version.split()[0])'
date -u +%s > /etc/clade/provisioned
