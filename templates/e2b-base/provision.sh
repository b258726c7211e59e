#!/bin/sh
# Runs once inside the booted sandbox when the base is built (the base is marked after it succeeds).
set -eu
# E2B's user: uid/gid 1000, a home of its own, bash, in the sudo group.
if ! id user >/dev/null 2>&1; then
  groupadd --gid 1000 user
  useradd --uid 1000 --gid 1000 --create-home --home-dir /home/user --shell /bin/bash --groups sudo user
fi
chown root:root /etc/sudoers.d/10-user
chmod 0440 /etc/sudoers.d/10-user
visudo -cf /etc/sudoers.d/10-user
python --version
curl --version | head -n1
git --version
node --version
date -u +%s > /etc/clade/provisioned
