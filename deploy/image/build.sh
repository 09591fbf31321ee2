#!/usr/bin/env bash
# Build moorage's container image without a Docker daemon:
#   deploy/image/build.sh OUT.tar [NAME:TAG] [PYTHON]
# 1. wheels of moorage and its Python dependencies, at the versions pinned in
#    deploy/image/constraints.txt (pyfuse3 built here against Debian's libfuse3);
# 2. a Debian bookworm root filesystem (mmdebstrap, minbase) with the host
#    packages moorage runs (ganesha + VFS, rpcbind, libnbd + nbdinfo, libnfs,
#    fuse3, e2fsprogs, xfsprogs, util-linux) and a virtualenv in /opt/moorage
#    holding those wheels, installed offline;
# 3. that tar as the one layer of an OCI image archive (deploy/image/oci.py),
#    which `ctr images import` takes.  One image serves every role.
set -euo pipefail
out=${1:?usage: build.sh OUT.tar [NAME:TAG] [PYTHON]}
ref=${2:-moorage:0.1.0}
python=${3:-python3}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the host's pip settings (find-links, indexes) have no place in the image
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_NO_INDEX

# built from a copy: setuptools writes build/ into the tree it builds; the
# developer's tools (moorage_dev: the demo, the dev cluster) stay out of it
mkdir "$work/src"
tar -C "$repo" --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./.moorage --exclude=./moorage_dev \
    --exclude='*.egg-info' --exclude='__pycache__' -cf - . | tar -C "$work/src" -xf -
"$python" -m pip wheel -q --wheel-dir "$work/wheels" -c "$here/constraints.txt" "$work/src[fuse]"

mmdebstrap --variant=minbase --mode=root --format=tar --quiet \
  --include=python3,python3-venv,nfs-ganesha,nfs-ganesha-vfs,rpcbind,libnbd0,libnbd-bin,libnfs13,libnfs-utils,fuse3,e2fsprogs,xfsprogs,util-linux,mount,kmod,ca-certificates,netbase \
  --customize-hook="mkdir -p \"\$1/tmp/wheels\" && cp $work/wheels/*.whl \"\$1/tmp/wheels/\"" \
  --customize-hook='chroot "$1" python3 -m venv /opt/moorage' \
  --customize-hook='chroot "$1" /opt/moorage/bin/pip install -q --no-index --find-links /tmp/wheels "moorage[fuse]"' \
  --customize-hook='rm -rf "$1/tmp/wheels" && ln -sf /opt/moorage/bin/moorage "$1/usr/local/bin/moorage"' \
  --customize-hook='ln -sf ../proc/self/mounts "$1/etc/mtab"' \
  bookworm "$work/rootfs.tar"

"$python" "$here/oci.py" "$work/rootfs.tar" "$out" "$ref" >/dev/null
echo "image $ref: $out ($(du -h "$out" | cut -f1), layer uncompressed)"
