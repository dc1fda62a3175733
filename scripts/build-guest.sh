#!/usr/bin/env bash
# Builds the microVM guest of space into OUT_DIR:
#   vmlinuz            Debian's cloud kernel (the package linux-image-cloud-amd64 depends on)
#   initramfs.cpio.gz  busybox-static, the virtio/vsock/virtio-net modules, resize2fs and /init
#                      (guest/init.sh)
#   VERSION            one line: "<kernel package>=<version> <hash of the initramfs inputs>"
# The host appends the agent to the initramfs at boot (space_runtime::guest::initramfs_with_agent).
#
# Idempotent: nothing is rebuilt when VERSION already names the same inputs. Reproducible:
# fixed mtimes, owners and ordering, gzip without a name or time stamp. The only network use
# is Debian's apt (packages and the kernel .deb, which is never installed on the host).
#
# Usage: scripts/build-guest.sh OUT_DIR
set -euo pipefail
# Retries for a mirror that does not answer for a moment (scripts/apt.conf).
export APT_CONFIG="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/apt.conf"

if [ "$#" -ne 1 ] || [ -z "$1" ]; then
  echo "usage: scripts/build-guest.sh OUT_DIR" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$1"
out="$(cd "$1" && pwd)"
init_src="$here/guest/init.sh"
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

say() { echo "build-guest: $*" >&2; }
die() { say "$*"; exit 1; }

updated=0
apt_update() {
  if [ "$updated" -eq 0 ]; then
    apt-get update -q >/dev/null
    updated=1
  fi
}
need_root() {
  [ "$(id -u)" -eq 0 ] || die "$* (run as root, or run scripts/setup.sh first)"
}

# --- host packages -----------------------------------------------------------------------
# QEMU: bookworm-backports (10.x, matching the backports qemu-utils) when setup.sh configured
# it, else the release's own (7.2); both run `-M microvm`.
if ! command -v qemu-system-x86_64 >/dev/null || ! command -v qemu-img >/dev/null; then
  need_root "qemu-system-x86 is missing"
  apt_update
  if grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    say "installing qemu-system-x86 from bookworm-backports"
    apt-get install -y -q -t bookworm-backports qemu-system-x86 qemu-utils >/dev/null
  else
    say "installing qemu-system-x86"
    apt-get install -y -q qemu-system-x86 qemu-utils >/dev/null
  fi
fi
missing=()
for pkg in busybox-static cpio e2fsprogs; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  need_root "${missing[*]} missing"
  say "installing ${missing[*]}"
  apt_update
  apt-get install -y -q "${missing[@]}" >/dev/null
fi

# --- which kernel ------------------------------------------------------------------------
kernel_pkg() {
  apt-cache depends linux-image-cloud-amd64 2>/dev/null \
    | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ { print $2; exit }'
}
kpkg="$(kernel_pkg || true)"
if [ -z "$kpkg" ]; then
  need_root "apt does not know linux-image-cloud-amd64"
  apt_update
  kpkg="$(kernel_pkg || true)"
fi
[ -n "$kpkg" ] || die "cannot find the kernel package that linux-image-cloud-amd64 depends on"
kver="$(apt-cache show --no-all-versions "$kpkg" | awk '$1 == "Version:" { print $2; exit }')"
[ -n "$kver" ] || die "cannot find the version of $kpkg"

busybox_bin=/bin/busybox
resize2fs_bin="$(command -v resize2fs || echo /sbin/resize2fs)"
[ -x "$resize2fs_bin" ] || die "resize2fs not found"
inputs_hash="$(
  {
    cat "$0" "$init_src"
    dpkg-query -W -f='${Package}=${Version}\n' busybox-static e2fsprogs libext2fs2 libc6 2>/dev/null || true
  } | sha256sum | cut -c1-16
)"
version_line="$kpkg=$kver $inputs_hash"

if [ -f "$out/VERSION" ] && [ -f "$out/vmlinuz" ] && [ -f "$out/initramfs.cpio.gz" ] \
  && [ "$(cat "$out/VERSION")" = "$version_line" ]; then
  say "up to date in $out ($version_line)"
  exit 0
fi

work="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# --- the kernel package: downloaded once, extracted here, never installed ------------------
cache="$out/.cache"
mkdir -p "$cache"
deb="$(find "$cache" -maxdepth 1 -name "${kpkg}_${kver//:/%3a}_amd64.deb" -print -quit)"
if [ -z "$deb" ]; then
  say "downloading $kpkg $kver"
  # Old kernels in the cache are useless once the version moved on.
  find "$cache" -maxdepth 1 -name 'linux-image-*.deb' -delete
  if ! (cd "$work" && apt-get download -q "$kpkg=$kver" >/dev/null 2>"$work/apt.err"); then
    # Stale package lists name a kernel the mirror no longer has: refresh them and say so
    # (the next run picks up the new version; this one must not silently switch).
    cat "$work/apt.err" >&2
    [ "$(id -u)" -ne 0 ] || apt_update
    die "apt-get download $kpkg=$kver failed; if the package lists were stale, run this again"
  fi
  deb="$(find "$work" -maxdepth 1 -name "${kpkg}_*.deb" -print -quit)"
  [ -n "$deb" ] || die "apt-get download left no .deb"
  mv "$deb" "$cache/"
  deb="$cache/$(basename "$deb")"
fi
dpkg-deb -x "$deb" "$work/kernel"
vmlinuz="$(find "$work/kernel/boot" -maxdepth 1 -name 'vmlinuz-*' -print -quit)"
[ -n "$vmlinuz" ] || die "$deb has no /boot/vmlinuz-*"
moddir="$(find "$work/kernel/lib/modules" -mindepth 1 -maxdepth 1 -type d -print -quit)"
[ -n "$moddir" ] || die "$deb has no /lib/modules/<release>"

# --- modules and their dependencies ----------------------------------------------------------
# The .deb ships no modules.dep (depmod makes it at install), so dependencies come from each
# module's own modinfo `depends=` field. Modules are stored uncompressed under their names, in
# three groups, each loaded with insmod in the order its list gives:
#   /lib/modules/boot   always: the virtio-mmio bus, the root disk, the agent's port
#   /lib/modules/net    only for a sandbox with egress (space.net=): virtio-net
#   /lib/modules/vsock  only with space.vsock=1 (no driver asks for it yet; docs/FIRECRACKER.md)
# Under TCG each insmod costs tens of milliseconds of the boot, so nothing loads unused.
groups=(boot net vsock)
declare -A group_wanted=(
  [boot]="virtio_mmio virtio_blk virtio_console"
  [net]="virtio_net"
  [vsock]="vmw_vsock_virtio_transport"
)
declare -A modfile=()
while IFS= read -r -d '' f; do
  name="$(basename "$f")"
  name="${name%%.ko*}"
  modfile["${name//-/_}"]="$f"
done < <(find "$moddir/kernel" -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz' -print0)
# The find above binds -print0 only to the last -name; redo it properly for all suffixes.
modfile=()
while IFS= read -r -d '' f; do
  name="$(basename "$f")"
  name="${name%%.ko*}"
  modfile["${name//-/_}"]="$f"
done < <(find "$moddir/kernel" \( -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz' \) -print0)

stage="$work/root"
mkdir -p "$stage"/{bin,sbin,dev,proc,sys,newroot,etc,lib/modules}
decompress() { # src dst
  case "$1" in
    *.ko) cp "$1" "$2" ;;
    *.ko.xz) xz -dc "$1" >"$2" ;;
    *.ko.zst) zstd -qdc "$1" >"$2" ;;
    *.ko.gz) gzip -dc "$1" >"$2" ;;
  esac
}
declare -A done_mod=()
order=()
loaded=()
add_module() { # name [chain]
  local m="$1" dep deps
  [ -n "${done_mod[$m]:-}" ] && return 0
  done_mod[$m]=visiting
  if [ -z "${modfile[$m]:-}" ]; then
    # Built into the kernel: nothing to load.
    grep -qE "/$m\.ko\$" "$moddir/modules.builtin" 2>/dev/null \
      || grep -qE "/${m//_/[-_]}\.ko\$" "$moddir/modules.builtin" 2>/dev/null \
      || die "module $m is neither a module nor built in"
    done_mod[$m]=builtin
    return 0
  fi
  decompress "${modfile[$m]}" "$stage/lib/modules/$m.ko"
  deps="$(tr '\0' '\n' <"$stage/lib/modules/$m.ko" | sed -n 's/^depends=//p' | head -n1)"
  for dep in ${deps//,/ }; do
    dep="${dep//-/_}"
    [ "${done_mod[$dep]:-}" = visiting ] && die "module dependency cycle at $dep"
    add_module "$dep"
  done
  done_mod[$m]=done
  order+=("$m")
}
for g in "${groups[@]}"; do
  # A group lists what it adds to the groups before it (their modules are loaded by then).
  order=()
  for m in ${group_wanted[$g]}; do add_module "$m"; done
  printf '%s\n' "${order[@]}" >"$stage/lib/modules/$g"
  loaded+=("$g: ${order[*]}")
done

# --- busybox, resize2fs, /init ----------------------------------------------------------------
cp "$busybox_bin" "$stage/bin/busybox"
"$busybox_bin" --list | grep -vx busybox | while read -r a; do ln -s busybox "$stage/bin/$a"; done
# resize2fs is dynamic in Debian: bring its libraries and loader along.
install -D -m 0755 "$resize2fs_bin" "$stage/sbin/resize2fs"
ldd "$resize2fs_bin" | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i }' | sort -u \
  | while read -r lib; do
      real="$(readlink -f "$lib")"
      install -D -m 0755 "$real" "$stage$lib"
    done
ln -s /proc/mounts "$stage/etc/mtab"
install -m 0755 "$init_src" "$stage/init"

# --- pack ---------------------------------------------------------------------------------------
find "$stage" -exec touch -h -d @0 {} +
(
  cd "$stage"
  find . -mindepth 1 -printf '%P\0' | sort -z \
    | cpio --null --create --format=newc --reproducible --owner=0:0 --quiet
) | gzip -9 -n >"$work/initramfs.cpio.gz"
install -m 0644 "$vmlinuz" "$work/vmlinuz"
touch -d @0 "$work/vmlinuz" "$work/initramfs.cpio.gz"
printf '%s\n' "$version_line" >"$work/VERSION"

# Each rename is atomic; VERSION goes last, so a half-updated directory never looks current.
rm -f "$out/VERSION"
mv -f "$work/vmlinuz" "$out/vmlinuz"
mv -f "$work/initramfs.cpio.gz" "$out/initramfs.cpio.gz"
mv -f "$work/VERSION" "$out/VERSION"
say "built $out: $kpkg $kver, modules: ${loaded[*]}, $(stat -c %s "$out/initramfs.cpio.gz") bytes of initramfs"
