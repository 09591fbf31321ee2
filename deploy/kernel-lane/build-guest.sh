#!/usr/bin/env bash
# The kernel lane's guest (docs/kernel-lane.md):
#   deploy/kernel-lane/build-guest.sh OUT_DIR
# A Debian bookworm root filesystem (mmdebstrap, minbase) with Debian's cloud
# kernel, whose package carries nbd.ko and the NFS client this host's kernel
# lacks, and the host packages moorage's node side runs (the same list as the
# container image, plus nfs-common for the kernel NFS client).  OUT_DIR gets:
#   vmlinuz     the kernel, booted by QEMU with -kernel;
#   base.cpio   the whole root filesystem as an initramfs (newc), with
#               deploy/kernel-lane/init as /init: the guest runs from RAM and
#               needs no disk image, initrd tool or virtual-disk driver.
# moorage itself is not in it: each run appends a second archive holding the
# tree under test (tests/kernel/guest.py), so a change to the code never
# rebuilds this.
set -euo pipefail
out=${1:?usage: build-guest.sh OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mmdebstrap --variant=minbase --mode=root --format=directory --quiet \
  --include=linux-image-cloud-amd64,python3,python3-venv,libfuse3-3,fuse3,libnbd0,libnbd-bin,libnfs13,nfs-common,e2fsprogs,xfsprogs,util-linux,mount,kmod,iproute2,procps,netbase \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  bookworm "$work/root"

root=$work/root
kernels=("$root"/boot/vmlinuz-*)
[ ${#kernels[@]} -eq 1 ] || { echo "build-guest: expected one kernel, found ${kernels[*]}" >&2; exit 1; }
install -D -m 0755 "$here/init" "$root/init"
ln -sf /proc/self/mounts "$root/etc/mtab"
mkdir -p "$out.partial"
cp "${kernels[0]}" "$out.partial/vmlinuz"
# /boot (the kernel again, and an initrd nothing uses) stays out of the archive
(cd "$root" && find . -path ./boot -prune -o -print | LC_ALL=C sort | cpio -o -H newc --quiet) \
    > "$out.partial/base.cpio"
basename "${kernels[0]}" | sed 's/^vmlinuz-//' > "$out.partial/kernel-release"
rm -rf "$out"
mv "$out.partial" "$out"
echo "guest: $out ($(cat "$out/kernel-release"), $(du -h "$out/base.cpio" | cut -f1) root filesystem)"
