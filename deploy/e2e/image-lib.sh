# Shell helpers for the scripts that build the e2e cluster's images
# (build-images.sh, build-suite-images.sh); sourced, not run.  The caller
# sets: work (a scratch directory), out (where archives go), python, oci
# (deploy/image/oci.py) and PROG (its name, for messages).

PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

die() { echo "$PROG: $*" >&2; exit 1; }

# pack DIR REFERENCE OCI_OPTIONS...: DIR as the one layer of REFERENCE's archive
pack() {
    local dir=$1 ref=$2 archive=$out/$2.tar
    shift 2
    chmod 0755 "$dir"
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --format=gnu \
        -C "$dir" -cf "$work/layer.tar" .
    mkdir -p "$(dirname "$archive")"
    "$python" "$oci" "$work/layer.tar" "$archive" "$ref" "$@" >/dev/null
    rm -rf "$work/layer.tar" "$dir"
    echo "$PROG: $ref ($(du -h "$archive" | cut -f1))"
}

# busybox_version: the X.Y of this host's static busybox
busybox_version() {
    local busybox=/bin/busybox tag
    [ -x "$busybox" ] && ! grep -q INTERP <<<"$(readelf -l "$busybox")" ||
        die "$busybox is missing or not static (install busybox-static: make host)"
    tag=$("$busybox" | sed -n '1s/^BusyBox v\([0-9]*\.[0-9]*\)\..*/\1/p')
    [ -n "$tag" ] || die "no version from $busybox"
    echo "$tag"
}

# busybox_root DIR: a root filesystem of Debian's busybox-static, each applet
# linked where busybox installs it
busybox_root() {
    local root=$1 busybox=/bin/busybox
    mkdir -p "$root/bin" "$root/tmp" "$root/root"
    chmod 1777 "$root/tmp"
    chmod 0700 "$root/root"
    cp "$busybox" "$root/bin/busybox"
    "$busybox" --list-full | while read -r applet; do
        [ "$applet" = bin/busybox ] && continue
        mkdir -p "$root/$(dirname "$applet")"
        ln -s /bin/busybox "$root/$applet"
    done
}

# debian_image REFERENCE PACKAGES ENTRYPOINT CMD: Debian bookworm minbase with
# PACKAGES (comma-separated), made by mmdebstrap
debian_image() {
    local ref=$1 packages=$2 entrypoint=$3 cmd=$4
    mmdebstrap --variant=minbase --mode=root --format=tar --quiet --include="$packages" \
        bookworm "$work/rootfs.tar"
    mkdir -p "$(dirname "$out/$ref.tar")"
    "$python" "$oci" "$work/rootfs.tar" "$out/$ref.tar" "$ref" --entrypoint "$entrypoint" \
        --cmd "$cmd" --env "$PATH_ENV" \
        --created-by "mmdebstrap bookworm --include=$packages" >/dev/null
    rm -f "$work/rootfs.tar"
    echo "$PROG: $ref ($(du -h "$out/$ref.tar" | cut -f1))"
}
