#!/bin/busybox sh
# /init of the space microVM initramfs (built by scripts/build-guest.sh).
#
# Contract with the host (space_runtime::microvm):
#   kernel command line: space.id=<sandbox id> [space.pids=<n>] [space.disk=1]
#     [space.hostname=<name>] [space.failpoint=<name>] (a test hook of the agent)
#     [space.vsock=1] (loads the virtio-vsock modules; for a driver whose agent channel is
#     vsock, docs/FIRECRACKER.md); anything else is ignored. Never the token: /proc/cmdline is
#     readable by every process of the guest, and QEMU's argv by every user of the host.
#   /space-token: the agent's token (0600), in a third cpio archive the host appends to the
#     sandbox's own initramfs. It is copied to /.space/run/token for the agent, which
#     deletes it; the initramfs' copy is deleted here.
#   space.net=ADDR/PREFIX,GATEWAY (egress sandboxes only): eth0, the one virtio-net NIC, gets
#     that address and a default route; IPv6 is switched off.
#   /dev/vda (first virtio-blk device): the root filesystem, ext4. With space.disk=1 it is
#     grown online to the size of the device.
#   virtio-serial port named `space.agent`: the agent's byte stream to the host
#     (/dev/virtio-ports/space.agent inside the sandbox).
#   /space-agent: the agent, appended to this initramfs by the host as a second cpio archive.
# It loads the modules, mounts the root, binds the agent read-only into a read-only tmpfs at
# /.space/bin, puts the token in /.space/run/token, sets up egress, and becomes the agent
# (PID 1), which gives the root /dev /proc /sys /dev/pts /dev/shm, moves it over this
# initramfs (SPACE_NEW_ROOT) and enters it.
# On any failure it prints one `space-init: ...` line and powers the VM off.

export PATH=/bin:/sbin

fail() {
  echo "space-init: $*" >/dev/console 2>/dev/null || echo "space-init: $*"
  sync
  poweroff -f
  # Where power-off is not wired up, a reset with QEMU's -no-reboot still ends the VM.
  reboot -f
  while :; do sleep 1; done
}

mount -t devtmpfs -o mode=0755,nosuid devtmpfs /dev || fail "cannot mount devtmpfs on /dev"
exec </dev/console >/dev/console 2>&1
mount -t proc -o nosuid,nodev,noexec proc /proc || fail "cannot mount /proc"
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys || fail "cannot mount /sys"

id= pids= disk= hostname= net= failpoint= vsock=
read -r cmdline </proc/cmdline
set -f # words of the command line, never file names
for word in $cmdline; do
  case "$word" in
    space.id=*) id="${word#space.id=}" ;;
    space.pids=*) pids="${word#space.pids=}" ;;
    space.disk=*) disk="${word#space.disk=}" ;;
    space.hostname=*) hostname="${word#space.hostname=}" ;;
    space.net=*) net="${word#space.net=}" ;;
    space.failpoint=*) failpoint="${word#space.failpoint=}" ;;
    space.vsock=*) vsock="${word#space.vsock=}" ;;
  esac
done
set +f
[ -n "$id" ] || fail "no space.id= on the kernel command line"
[ -s /space-token ] || fail "no /space-token in the initramfs (the host appends it)"
case "$pids" in
  '' | *[!0-9]*) [ -z "$pids" ] || fail "space.pids=$pids is not a number" ;;
esac

# Loads the modules of one group (scripts/build-guest.sh), in order.
load_modules() {
  while read -r mod; do
    [ -n "$mod" ] || continue
    # EEXIST: already loaded (or built in on another kernel) is fine. No $(...) around
    # insmod: under TCG every extra fork costs the boot milliseconds.
    insmod "/lib/modules/$mod.ko" 2>/insmod.err || case "$(cat /insmod.err)" in
      *exists*) ;;
      *) fail "cannot load module $mod: $(cat /insmod.err)" ;;
    esac
  done <"/lib/modules/$1"
}
load_modules boot
# The agent makes module loading one-way off, so what a sandbox may use is loaded now.
[ -z "$net" ] || load_modules net
[ "$vsock" != 1 ] || load_modules vsock

# Devices appear while the drivers probe; wait for them (5 s at most, polled).
port=
tries=0
while :; do
  if [ -b /dev/vda ] && [ -z "$port" ]; then
    for p in /sys/class/virtio-ports/*; do
      [ -f "$p/name" ] && [ "$(cat "$p/name")" = space.agent ] && port="${p##*/}"
    done
  fi
  [ -b /dev/vda ] && [ -n "$port" ] && [ -c "/dev/$port" ] && break
  tries=$((tries + 1))
  if [ "$tries" -gt 500 ]; then
    [ -b /dev/vda ] || fail "no root disk /dev/vda (virtio-blk) after 5 s"
    fail "no virtio-serial port named space.agent after 5 s"
  fi
  sleep 0.01
done
mkdir -p /dev/virtio-ports
ln -sf "../$port" /dev/virtio-ports/space.agent

mount -t ext4 -o rw,noatime /dev/vda /newroot || fail "cannot mount /dev/vda (ext4) on /newroot"
if [ "$disk" = 1 ]; then
  # Online growth to the device's size: the sandbox's disk quota is the overlay's virtual size.
  out="$(resize2fs /dev/vda 2>&1)" || fail "cannot grow the root filesystem: $(echo "$out" | tail -n1)"
fi

r=/newroot
[ -d $r/.space ] || mkdir -m 0755 $r/.space || fail "cannot create /.space in the root filesystem"
mount -t tmpfs -o mode=0755,nosuid,nodev,size=1m space $r/.space || fail "cannot mount /.space"
mkdir -p -m 0755 $r/.space/bin $r/.space/run
mount -t tmpfs -o mode=0755,nosuid,nodev space-bin $r/.space/bin || fail "cannot mount /.space/bin"
[ -f /space-agent ] || fail "no /space-agent in the initramfs (the host appends it)"
# The agent is bound, read-only, over an empty file of that tmpfs: no copy (under TCG copying
# its megabytes took about a tenth of a second of every boot). The initramfs' own name for it
# goes when the agent empties the initramfs; the bind keeps the file.
chmod 0755 /space-agent
: >$r/.space/bin/space-agent || fail "cannot create /.space/bin/space-agent"
mount --bind /space-agent $r/.space/bin/space-agent || fail "cannot bind the agent"
mount -o remount,bind,ro,nosuid,nodev $r/.space/bin/space-agent \
  || fail "cannot make the agent read-only"
mount -o remount,ro,nosuid,nodev space-bin $r/.space/bin || fail "cannot make /.space/bin read-only"
mount -t tmpfs -o mode=0700,nosuid,nodev,noexec,size=1m space-run $r/.space/run || fail "cannot mount /.space/run"
(umask 077 && cp /space-token $r/.space/run/token) || fail "cannot write the token"
rm -f /space-token

if [ -n "$net" ]; then
  # Egress (space.net=ADDR/PREFIX,GATEWAY): the one virtio-net NIC, IPv4 only. What it
  # may reach is decided by the host's firewall, not here.
  tries=0
  while [ ! -e /sys/class/net/eth0 ]; do
    tries=$((tries + 1))
    [ "$tries" -le 100 ] || fail "space.net is set but no eth0 (virtio-net) after 5 s; interfaces: $(ls /sys/class/net | tr '\n' ' ')"
    sleep 0.05
  done
  for f in /proc/sys/net/ipv6/conf/*/disable_ipv6; do echo 1 >"$f" 2>/dev/null; done
  ip addr add "${net%,*}" dev eth0 || fail "cannot set the address ${net%,*} on eth0"
  ip link set eth0 up || fail "cannot bring eth0 up"
  ip route add default via "${net#*,}" dev eth0 || fail "cannot route via ${net#*,}"
fi

# The rest is the agent's (space_agent::guest::finish_root), in system calls rather than a
# process a step: /dev, /proc and /sys moved into the root, /dev/pts, /dev/shm, the /dev links,
# /tmp's mode, lo up and the host name.

# No switch_root here: its chroot would move the kernel's own root (shared by PID 1 and the
# kernel threads, which look up usermode helpers such as modprobe there) into the sandbox's
# filesystem. The agent enters $r itself, in a root of its own, and leaves the kernel this
# initramfs, emptied (space_agent's `guest` module).
exec env -i \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  SPACE_SANDBOX_ID="$id" \
  SPACE_AGENT_TOKEN_FILE=/.space/run/token \
  SPACE_PIDS_LIMIT="$pids" \
  SPACE_FAILPOINT="$failpoint" \
  SPACE_AGENT_PORT=/dev/virtio-ports/space.agent \
  SPACE_NEW_ROOT=$r \
  SPACE_HOSTNAME="${hostname:-$id}" \
  $r/.space/bin/space-agent
fail "cannot start the agent"
