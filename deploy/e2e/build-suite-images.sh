#!/usr/bin/env bash
# Build the images Kubernetes' External Storage suite runs its pods from, under
# the names that release's e2e.test asks for (test/utils/image/manifest.go):
#   deploy/e2e/build-suite-images.sh KUBERNETES_VERSION AGNHOST OUTDIR [GO] [PYTHON]
#
#   registry.k8s.io/e2e-test-images/agnhost:TAG         AGNHOST (built from
#        test/images/agnhost by build-conformance.sh) on a busybox root, as its
#        Dockerfile lays it out: /agnhost, /agnhost-2, /uploads, the user 1000
#        and group 50000 its tests expect
#   registry.k8s.io/e2e-test-images/busybox:TAG         this host's busybox-static
#   registry.k8s.io/e2e-test-images/nginx:TAG           Debian's nginx-light
#   registry.k8s.io/e2e-test-images/jessie-dnsutils:TAG Debian's dnsutils
#
# No registry is reachable here, so each is built from what this machine has
# (Debian packages, the release's own source); the versions inside are
# Debian's, the names the suite's (docs/e2e.md).  OUTDIR/images.txt lists them.
set -euo pipefail
usage="usage: build-suite-images.sh KUBERNETES_VERSION AGNHOST OUTDIR [GO] [PYTHON]"
kube_version=${1:?$usage}
agnhost=${2:?$usage}
out=${3:?$usage}
go=${4:-go}
python=${5:-python3}
here=$(cd "$(dirname "$0")" && pwd)
oci=$here/../image/oci.py
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PROG=build-suite-images
# shellcheck source=deploy/e2e/image-lib.sh
. "$here/image-lib.sh"

[ -x "$agnhost" ] || die "no agnhost binary at $agnhost"
json=$(cd / && GOFLAGS=-mod=mod "$go" mod download -json "k8s.io/kubernetes@$kube_version")
kdir=$(sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p' <<<"$json")
manifest=$kdir/test/utils/image/manifest.go
[ -f "$manifest" ] || die "no $manifest"

# suite_ref ID NAME: the reference e2e.test uses for its image ID (configs[ID] in
# manifest.go), an e2e-test-images NAME
suite_ref() {
    local tag
    tag=$(sed -n "s|^\s*configs\[$1\] = Config{list.PromoterE2eRegistry, \"$2\", \"\(.*\)\"}|\1|p" "$manifest")
    [ -n "$tag" ] && [ "$(wc -l <<<"$tag")" = 1 ] || die "no one configs[$1] e2e-test-images/$2 in $manifest"
    echo "registry.k8s.io/e2e-test-images/$2:$tag"
}

mkdir -p "$out"
index=()

ref=$(suite_ref BusyBox busybox)
index+=("busybox $ref")
if [ ! -f "$out/$ref.tar" ]; then
    busybox_root "$work/busybox"
    pack "$work/busybox" "$ref" --entrypoint '[]' --cmd '["sh"]' --env "$PATH_ENV" \
        --created-by "$(/bin/busybox | sed -n 1p)"
fi

ref=$(suite_ref Agnhost agnhost)
index+=("agnhost $ref")
if [ ! -f "$out/$ref.tar" ]; then
    root=$work/agnhost
    busybox_root "$root"
    install -m 0755 "$agnhost" "$root/agnhost"
    ln -s agnhost "$root/agnhost-2"
    mkdir -p "$root/uploads" "$root/etc" "$root/home/user-defined-in-image"
    printf 'root:x:0:0:root:/root:/bin/sh\nuser-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n' \
        > "$root/etc/passwd"
    printf 'root:x:0:\nuser-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\n' \
        > "$root/etc/group"
    pack "$root" "$ref" --entrypoint '["/agnhost"]' --cmd '["pause"]' --env "$PATH_ENV" \
        --created-by "go build k8s.io/kubernetes/test/images/agnhost@$kube_version on $(/bin/busybox | sed -n 1p)"
fi

ref=$(suite_ref Nginx nginx)
index+=("nginx $ref")
[ -f "$out/$ref.tar" ] || debian_image "$ref" nginx-light '["nginx", "-g", "daemon off;"]' '[]'

ref=$(suite_ref JessieDnsutils jessie-dnsutils)
index+=("jessie-dnsutils $ref")
[ -f "$out/$ref.tar" ] || debian_image "$ref" dnsutils '[]' '["sh"]'

for line in "${index[@]}"; do
    read -r role ref <<<"$line"
    echo "$role $ref $ref.tar"
done > "$work/images.txt"
mv "$work/images.txt" "$out/images.txt"
echo "$PROG: $(wc -l < "$out/images.txt") images in $out"
