#!/usr/bin/env bash
# scripts/guest-kernel.sh [SUITE]: another Debian suite's guest kernel (default trixie, Debian's stable),
# fetched and extracted beside the one `./x setup` installed, which stays `current`. Prints its directory
# ($CLADE_HOME/kernel/<release>). For measurements that need a newer kernel than the host's suite ships:
# `./x bench scale` runs the browser's mark pause in a vm guest on it, since CRIU finds a process's pages with
# the PAGEMAP_SCAN ioctl only from Linux 6.7 (docs/scale.md, "The browser's mark pause").
# The .deb stays in $CLADE_HOME/debs/kernel-SUITE: a second run touches no network.
set -euo pipefail
CLADE_HOME=${CLADE_HOME:-/var/lib/clade}
suite=${1:-trixie}
say() { echo "guest-kernel: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }
. "$(dirname "${BASH_SOURCE[0]}")/debian-lib.sh"
[ "$(id -u)" = 0 ] || die "run as root (as ./x setup)"
debs="$CLADE_HOME/debs/kernel-$suite"
mkdir -p "$debs" "$CLADE_HOME/kernel" "$CLADE_HOME/tmp"
deb=$(ls "$debs"/linux-image-*-amd64_*.deb 2>/dev/null | sort -V | tail -n1 || true)
if [ -z "$deb" ]; then
  private_apt "$CLADE_HOME/apt-$suite" "$suite"
  pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  [ -n "$pkg" ] || die "$suite's lists resolve linux-image-amd64 to no kernel package"
  say "downloading $suite's guest kernel $pkg (not installed as the host's kernel)"
  (cd "$debs" && apt-get download -qq "$pkg") || die "could not download $pkg from $suite"
  unset APT_CONFIG
  deb=$(ls "$debs"/linux-image-*-amd64_*.deb | sort -V | tail -n1)
fi
# The release is the package's name between `linux-image-` and `_`.
kver=$(basename "$deb"); kver=${kver#linux-image-}; kver=${kver%%_*}
if [ ! -f "$CLADE_HOME/kernel/$kver/modules/modules.dep" ] || [ ! -f "$CLADE_HOME/kernel/$kver/vmlinux" ]; then
  kver=$(extract_kernel "$deb")
fi
echo "$CLADE_HOME/kernel/$kver"
