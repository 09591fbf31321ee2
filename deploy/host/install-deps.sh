#!/usr/bin/env bash
# Host set-up for a moorage storage node or worker node, and for developing
# moorage itself, on Debian 12 (or a derivative) as root.  Idempotent: it
# installs only the packages that are missing and does nothing else when all
# are present.
set -euo pipefail

die() { echo "install-deps: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (it installs Debian packages with apt-get)"
command -v apt-get >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1 \
    || die "this is not a Debian-like system (no apt-get/dpkg-query); install the packages listed in $0 by hand"

packages=(
    # NFS server: ganesha with its VFS backend; rpcbind for NFSv3's MOUNT protocol
    nfs-ganesha nfs-ganesha-vfs rpcbind
    # NBD client library and tools (nbdinfo, nbdcopy) used by attach and tests
    libnbd0 libnbd-bin
    # userspace NFS client library and tools (nfs-cp, nfs-ls, nfs-cat)
    libnfs13 libnfs-utils
    # FUSE: pyfuse3 builds against libfuse3 through pkg-config
    fuse3 libfuse3-dev pkg-config
    # filesystems and block tooling
    xfsprogs e2fsprogs util-linux btrfs-progs
    # network namespaces for access-control tests
    iproute2
    # TLS test material (certtool) for the NBD TLS tests
    gnutls-bin
    # peers used by the tests and benchmarks
    qemu-utils nbdkit fio
    # PostgreSQL server binaries: the catalog's tests start a throwaway cluster
    postgresql
    # building the virtualenv
    python3 python3-venv python3-dev gcc make
    # systemd-analyze verify checks the storage node's units in deploy/systemd
    systemd
    # the container image: a root filesystem without a Docker daemon, and
    # containerd (with ctr and runc) to import and run it in the tests
    mmdebstrap containerd
    # the e2e cluster (docs/e2e.md): the CNI plugins its pods' network is made
    # of (bridge, host-local, loopback, portmap in /usr/lib/cni); iptables and
    # conntrack for kube-proxy and portmap; a static busybox for the examples'
    # image, built by make e2e-tools
    containernetworking-plugins iptables conntrack busybox-static
    # kernel uapi headers (linux/nbd-netlink.h, linux/nbd.h, linux/netlink.h): the
    # kernel nbd attach code's hard-coded values are tested against them
    linux-libc-dev
    # the kernel lane (docs/kernel-lane.md): a guest with Debian's cloud kernel,
    # whose nbd and NFS client this host's kernel lacks, under QEMU, booted
    # from an initramfs (cpio) holding its whole root filesystem
    qemu-system-x86 cpio
)
# Packages whose own service must not run here: Debian's prometheus (its
# promtool checks and unit-tests the chart's alerts; the tests start their own
# Prometheus on loopback, docs/monitoring.md).  Installed on their own, below.
quiet_packages=(prometheus)

# While a quiet package installs, /usr/sbin/policy-rc.d is one of ours (its
# marker line tells it apart) and the host's own, if any, waits under a fixed
# name beside it.  A run killed in the middle (SIGKILL, OOM, power loss) leaves
# both, and ours forbids every service start on the host: every run puts them
# right first, before it decides whether it has anything to install.
policy=/usr/sbin/policy-rc.d
policy_kept=$policy.install-deps-orig
policy_new=$policy.install-deps-new
policy_marker='# install-deps.sh: no service starts while it installs a package whose service must not run'
present() { [ -e "$1" ] || [ -L "$1" ]; }
policy_is_ours() { [ -f "$policy" ] && [ ! -L "$policy" ] && grep -qxF "$policy_marker" "$policy"; }
restore_policy() {
    rm -f "$policy_new"
    if present "$policy"; then
        if ! policy_is_ours; then
            if present "$policy_kept"; then
                echo "install-deps: warning: $policy is not install-deps.sh's, so $policy_kept (the one an earlier run put aside) is left for you to put back" >&2
            fi
            return 0
        fi
        rm -f "$policy"
    fi
    if present "$policy_kept"; then mv -T "$policy_kept" "$policy"; fi
}
restore_policy

missing=()
quiet_missing=()
for p in "${packages[@]}" "${quiet_packages[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] && continue
    if [[ " ${quiet_packages[*]} " == *" $p "* ]]; then quiet_missing+=("$p"); else missing+=("$p"); fi
done

if [ ${#missing[@]} -eq 0 ] && [ ${#quiet_missing[@]} -eq 0 ]; then
    echo "install-deps: all $(( ${#packages[@]} + ${#quiet_packages[@]} )) host packages present"
    exit 0
fi

echo "install-deps: installing ${missing[*]} ${quiet_missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The quiet packages' maintainer scripts start their service through
# invoke-rc.d or deb-systemd-invoke, both of which ask /usr/sbin/policy-rc.d
# first: one that answers 101 (action forbidden) for the length of their
# install keeps the service from ever starting.  The host's own policy-rc.d is
# moved aside (a symlink stays a symlink, and what it points to is never
# written) and put back as it was, by the trap when the install fails, or by
# the next run when this one is killed.
if [ ${#quiet_missing[@]} -gt 0 ]; then
    if present "$policy_kept"; then
        die "$policy_kept is in the way (an earlier run's copy of the host's $policy, not put back because $policy changed since): put it back or remove it"
    fi
    trap restore_policy EXIT
    if present "$policy"; then mv -T "$policy" "$policy_kept"; fi
    printf '#!/bin/sh\n%s\nexit 101\n' "$policy_marker" > "$policy_new"
    chmod 0755 "$policy_new"
    mv -T "$policy_new" "$policy"
    apt-get install -y -qq --no-install-recommends "${quiet_missing[@]}"
    restore_policy
    trap - EXIT
    # and none starts at boot either; a failure to disable it is reported, as
    # the service would start at the next boot
    for p in "${quiet_missing[@]}"; do
        if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
            if ! out=$(systemctl disable "$p.service" 2>&1); then
                echo "install-deps: warning: systemctl disable $p.service failed, so it starts at the next boot: $out" >&2
            fi
        elif [ -x "/etc/init.d/$p" ]; then
            if ! out=$(update-rc.d "$p" disable 2>&1); then
                echo "install-deps: warning: update-rc.d $p disable failed, so it starts at the next boot: $out" >&2
            fi
        fi
    done
fi

# The Debian package enables ganesha's own service; moorage runs ganesha
# itself, with its own configuration, so the packaged one must not hold the
# NFS ports.
# Only when this run installed it: never touch a ganesha that was running
# before (an operator's, or a test's).
if [[ " ${missing[*]} " == *" nfs-ganesha "* ]]; then
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl disable --now nfs-ganesha.service >/dev/null 2>&1 || true
    elif [ -x /etc/init.d/nfs-ganesha ]; then
        /etc/init.d/nfs-ganesha stop >/dev/null 2>&1 || true
    fi
fi

# The Debian package creates and starts a cluster on port 5432; nothing here
# uses it (the tests run their own), so stop it and keep it from starting at
# boot.  Only when this run installed it: an operator's own PostgreSQL stays.
if [[ " ${missing[*]} " == *" postgresql "* ]]; then
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl disable --now postgresql.service >/dev/null 2>&1 || true
    fi
    # Without systemd the package started its clusters through the init script.
    pg_lsclusters -h 2>/dev/null | while read -r version cluster _port status _rest; do
        case "$status" in
            online*) pg_ctlcluster "$version" "$cluster" stop >/dev/null 2>&1 || true ;;
        esac
    done
fi
# containerd is for the tests, which start their own on private sockets: a
# packaged one this run started (systemd hosts) is stopped and not enabled.
if [[ " ${missing[*]} " == *" containerd "* ]]; then
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl disable --now containerd.service >/dev/null 2>&1 || true
    fi
fi
echo "install-deps: done"
