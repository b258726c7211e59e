# Shared by scripts/setup.sh and scripts/guest-kernel.sh (sourced; expects `say` and `die` and $CLADE_HOME).

# private_apt DIR SUITE [MIRROR]: a private apt configuration in DIR for one Debian suite, its package lists
# fetched; exports APT_CONFIG for the calls that follow (unset it after). The host's own sources are not changed.
private_apt() {
  local dir=$1 suite=$2 mirror=${3:-http://deb.debian.org/debian}
  mkdir -p "$dir"/{lists/partial,cache/archives/partial,sources.list.d,preferences.d,apt.conf.d}
  touch "$dir/status"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" > "$dir/sources.list"
  cat > "$dir/apt.conf" <<APT
Dir::Etc::SourceList "$dir/sources.list";
Dir::Etc::SourceParts "$dir/sources.list.d";
Dir::Etc::Parts "$dir/apt.conf.d";
Dir::Etc::Preferences "$dir/preferences";
Dir::Etc::PreferencesParts "$dir/preferences.d";
Dir::State::Lists "$dir/lists";
Dir::State::status "$dir/status";
Dir::Cache "$dir/cache";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
Acquire::Languages "none";
Acquire::Check-Valid-Until "false";
APT::Sandbox::User "root";
APT
  export APT_CONFIG="$dir/apt.conf"
  say "fetching Debian $suite's package lists into a private apt configuration ($dir)"
  apt-get update -qq || die "could not fetch $suite's package lists: the Debian mirror ($mirror) must be reachable"
}

# extract_kernel DEB: Debian's linux-image .deb extracted into $CLADE_HOME/kernel/<release> (`vmlinuz`, the
# uncompressed ELF `vmlinux`, `modules/` with a modules.dep, `config`, `release`), through a temporary
# directory renamed into place when complete. Prints the release. Compressed modules (`.ko.xz`, Debian's since
# trixie) are decompressed, since the guest's initramfs loads them with busybox's insmod.
extract_kernel() {
  local deb=$1 tmp vmlinuz kver off z
  say "extracting guest kernel from $(basename "$deb")"
  tmp=$(mktemp -d "$CLADE_HOME/tmp/kernel.XXXXXX")
  fail() { rm -rf "$tmp"; die "$@"; }
  dpkg-deb -x "$deb" "$tmp/root" || fail "could not unpack $deb (a partial download? remove it and run again)"
  vmlinuz=$(ls "$tmp"/root/boot/vmlinuz-* 2>/dev/null | head -n1 || true)
  [ -n "$vmlinuz" ] || fail "$deb holds no boot/vmlinuz-*: not a linux-image package"
  kver=${vmlinuz##*/vmlinuz-}
  mkdir -p "$tmp/k"
  [ -d "$tmp/root/lib/modules/$kver" ] || { mkdir -p "$tmp/root/lib/modules"; mv "$tmp/root/usr/lib/modules/$kver" "$tmp/root/lib/modules/"; }
  find "$tmp/root/lib/modules/$kver" -name '*.ko.xz' -exec xz -dq {} + || fail "could not decompress the modules of $kver (is xz-utils installed?)"
  # Debian's package ships no modules.dep (depmod runs at install time): make it, so the initramfs builder
  # can load each module after its dependencies.
  depmod -b "$tmp/root" "$kver" || fail "depmod failed for the guest kernel $kver (is kmod installed?)"
  cp "$vmlinuz" "$tmp/k/vmlinuz"
  cp "$tmp/root/boot/config-$kver" "$tmp/k/config" 2>/dev/null || true
  mv "$tmp/root/lib/modules/$kver" "$tmp/k/modules"
  echo "$kver" > "$tmp/k/release"
  # The uncompressed ELF (boots ~2x faster under TCG): the first xz (bookworm) or zstd (trixie) stream inside
  # the bzImage, decompressed.
  for z in '\xfd7zXZ\x00:xz' '\x28\xb5\x2f\xfd:zstd'; do
    off=$(LC_ALL=C grep -obUaP "${z%%:*}" "$tmp/k/vmlinuz" 2>/dev/null | head -n1 | cut -d: -f1)
    [ -n "$off" ] || continue
    tail -c +$((off + 1)) "$tmp/k/vmlinuz" | "${z##*:}" -dcq > "$tmp/k/vmlinux" 2>/dev/null || true
    head -c 4 "$tmp/k/vmlinux" | grep -q 'ELF' && break
  done
  head -c 4 "$tmp/k/vmlinux" 2>/dev/null | grep -q 'ELF' \
    || fail "could not extract an ELF vmlinux from $vmlinuz (no xz or zstd stream; are xz-utils and zstd installed?)"
  rm -rf "$CLADE_HOME/kernel/$kver"
  mv "$tmp/k" "$CLADE_HOME/kernel/$kver"
  rm -rf "$tmp"
  echo "$kver"
}
