#!/usr/bin/env bash
# Build the container images a local Kubernetes cluster runs besides
# moorage's own, each an OCI image archive that `ctr images import` takes:
#   deploy/e2e/build-images.sh VALUES.yaml KUBERNETES_VERSION OUTDIR THIRD_PARTY [GO] [PYTHON]
#
#   OUTDIR/registry.k8s.io/pause:TAG.tar   Kubernetes' pause, compiled from the C
#                                          source in the k8s.io/kubernetes module
#   OUTDIR/busybox:X.Y.tar                 this host's busybox-static (Debian)
#   OUTDIR/moorage-e2e-fio:X.Y.tar         Debian's fio (mmdebstrap), for the
#                                          e2e's I/O-limit measurement
#   OUTDIR/REPOSITORY:TAG.tar              each CSI sidecar the chart names in
#                                          VALUES.yaml (images.*), built from its
#                                          Go module at that tag, and the
#                                          snapshot-controller of the snapshotter's
#                                          release; the node-driver-registrar and
#                                          the livenessprobe from their release
#                                          sources in THIRD_PARTY (vendored: the Go
#                                          module proxy refuses their modules)
#   OUTDIR/manifests/crd/                  the VolumeSnapshot CRDs and the
#   OUTDIR/manifests/snapshot-controller/  snapshot-controller's RBAC and
#                                          Deployment, as that release ships them
#                                          (but for the image: the one built here)
#   OUTDIR/images.txt                      ROLE REFERENCE ARCHIVE, one a line
#
# An archive is named by the reference the chart (or Kubernetes) uses, so the
# versions live in VALUES.yaml and in the Kubernetes release only.  Each piece
# is built only when its file is missing.
set -euo pipefail
usage="usage: build-images.sh VALUES.yaml KUBERNETES_VERSION OUTDIR THIRD_PARTY [GO] [PYTHON]"
values=${1:?$usage}
kube_version=${2:?$usage}
out=${3:?$usage}
third_party=${4:?$usage}
go=${5:-go}
python=${6:-python3}
here=$(cd "$(dirname "$0")" && pwd)
oci=$here/../image/oci.py
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GOFLAGS=-mod=mod
PROG=build-images
# shellcheck source=deploy/e2e/image-lib.sh
. "$here/image-lib.sh"

# value IMAGE FIELD: images.IMAGE.FIELD in VALUES.yaml (a plain scalar)
value() {
    local v
    v=$(awk -v image="$1" -v field="$2" '
        /^[^ #]/ { inimages = ($0 ~ /^images:/); current = 0; next }
        inimages && /^  [^ #]/ { current = ($1 == image ":"); next }
        inimages && current && $1 == field ":" { v = $2; gsub(/["'\'']/, "", v); print v; exit }
    ' "$values")
    [ -n "$v" ] || die "no images.$1.$2 in $values"
    echo "$v"
}

# module_field MODULE@VERSION FIELD: Dir or GoMod of the downloaded module
module_field() {
    local json
    json=$(cd / && "$go" mod download -json "$1") || die "go mod download $1 failed: $json"
    local field
    field=$(sed -n "s/^\s*\"$2\": \"\(.*\)\",\?$/\1/p" <<<"$json")
    [ -e "$field" ] || die "go mod download $1 gave no $2"
    echo "$field"
}

# go_command MODULE VERSION COMMAND OUT: MODULE/cmd/COMMAND at VERSION, static,
# with the version stamped in as the kubernetes-csi release builds do.  `go
# install` is refused for these modules (their go.mod files have replace
# directives), and a dependency's replace directives are ignored, so a
# throwaway module requires MODULE and repeats them: a replacement by a
# published version as it is, one by a directory of MODULE's repository (a
# nested module) by that module at the same release.
go_command() {
    local module=$1 version=$2 command=$3 bin=$4 mod
    mod=$work/mod-$(tr / _ <<<"$module")
    if [ ! -f "$mod/go.sum" ]; then
        mkdir -p "$mod"
        local gomod
        gomod=$(module_field "$module@$version" GoMod)
        {
            printf 'module moorage.dev/e2e-images\n\ngo 1.24.0\n\nrequire %s %s\n\n' "$module" "$version"
            "$go" mod edit -json "$gomod" | "$python" -c '
import json, sys
version = sys.argv[1]
for r in json.load(sys.stdin).get("Replace") or []:
    old, new = r["Old"], r["New"]
    left = " ".join(filter(None, [old["Path"], old.get("Version")]))
    if new.get("Version"):
        print("replace", left, "=>", new["Path"], new["Version"])
    elif new["Path"].startswith("./"):
        print("replace", left, "=>", old["Path"], version)
    else:  # a directory outside the repository: nothing published to use
        sys.exit("build-images: cannot repeat replace " + left + " => " + new["Path"])
' "$version"
        } > "$mod/go.mod"
        printf '//go:build tools\n\npackage tools\n\nimport _ "%s/cmd/%s"\n' "$module" "$command" \
            > "$mod/tools.go"
        (cd "$mod" && "$go" mod tidy >/dev/null)
    fi
    (cd "$mod" && CGO_ENABLED=0 "$go" build -trimpath -ldflags "-X main.version=$version" \
        -o "$bin" "$module/cmd/$command")
}

mkdir -p "$out"
index=()

# --- pause: Kubernetes' own, C source in the k8s.io/kubernetes module
kdir=$(module_field "k8s.io/kubernetes@$kube_version" Dir)
pause_tag=$(sed -n 's/^TAG ?= *//p' "$kdir/build/pause/Makefile")
[ -n "$pause_tag" ] || die "no pause TAG in $kdir/build/pause/Makefile"
grep -q "PauseVersion = \"$pause_tag\"" "$kdir/cmd/kubeadm/app/constants/constants.go" ||
    die "pause $pause_tag (build/pause) is not kubeadm's PauseVersion in $kube_version"
ref=registry.k8s.io/pause:$pause_tag
index+=("pause $ref")
if [ ! -f "$out/$ref.tar" ]; then
    mkdir "$work/pause"
    # build/pause/Makefile's flags; the version it prints names the release it came from
    gcc -Os -Wall -Werror -static "-DVERSION=v$pause_tag-$kube_version" \
        -o "$work/pause/pause" "$kdir/build/pause/linux/pause.c"
    pack "$work/pause" "$ref" --entrypoint '["/pause"]' --env "$PATH_ENV" --user 65535:65535 \
        --created-by "gcc -static build/pause/linux/pause.c of k8s.io/kubernetes@$kube_version"
fi

# --- busybox: Debian's busybox-static, the applets linked where busybox installs them
ref=busybox:$(busybox_version)
index+=("busybox $ref")
if [ ! -f "$out/$ref.tar" ]; then
    busybox_root "$work/busybox"
    pack "$work/busybox" "$ref" --entrypoint '[]' --cmd '["sh"]' --env "$PATH_ENV" \
        --created-by "$(/bin/busybox | sed -n 1p)"
fi

# --- fio: Debian's, for the e2e's I/O-limit measurement in a pod
fio_tag=$(apt-cache policy fio | sed -n 's/^ *Candidate: *\([0-9]*\.[0-9]*\).*/\1/p')
[ -n "$fio_tag" ] || die "no fio candidate from apt-cache policy fio"
ref=moorage-e2e-fio:$fio_tag
index+=("fio $ref")
[ -f "$out/$ref.tar" ] || debian_image "$ref" fio,libaio1 '[]' '["fio", "--version"]'

# --- the CSI sidecars the chart runs, and the cluster's snapshot-controller
sidecar() {  # ROLE PROJECT REPOSITORY TAG: github.com/kubernetes-csi/PROJECT's command
    local role=$1 project=$2 repository=$3 tag=$4
    local command=${repository##*/} major=${tag%%.*}
    local ref=$repository:$tag
    local module=github.com/kubernetes-csi/$project/$major
    index+=("$role $ref")
    [ -f "$out/$ref.tar" ] && return
    mkdir -p "$work/$command/tmp"
    chmod 1777 "$work/$command/tmp"
    go_command "$module" "$tag" "$command" "$work/$command/$command"
    pack "$work/$command" "$ref" --entrypoint "[\"/$command\"]" --env "$PATH_ENV" \
        --created-by "go build $module/cmd/$command@$tag"
}
for role in provisioner attacher resizer snapshotter; do
    repository=$(value "$role" repository)
    tag=$(value "$role" tag)
    sidecar "$role" "external-$role" "$repository" "$tag"
done
# The node's sidecars: their modules are refused by the proxy, so they are
# built offline from the release source tarballs (git archive of the tag, with
# vendor/) in THIRD_PARTY, named PROJECT-TAG.tar.gz.
vendored_sidecar() {  # ROLE PROJECT COMMAND REPOSITORY TAG
    local role=$1 project=$2 command=$3 repository=$4 tag=$5
    local ref=$repository:$tag tarball=$third_party/$project-$tag.tar.gz
    index+=("$role $ref")
    [ -f "$out/$ref.tar" ] && return
    [ -f "$tarball" ] || die "no $tarball (the release source of $project $tag)"
    tar -xzf "$tarball" -C "$work"
    mkdir -p "$work/$command/tmp"
    chmod 1777 "$work/$command/tmp"
    (cd "$work/$project-$tag" && CGO_ENABLED=0 GOFLAGS=-mod=vendor "$go" build -trimpath \
        -ldflags "-X main.version=$tag" -o "$work/$command/$command" "./cmd/$command")
    rm -rf "${work:?}/$project-$tag"
    pack "$work/$command" "$ref" --entrypoint "[\"/$command\"]" --env "$PATH_ENV" \
        --created-by "go build -mod=vendor ./cmd/$command of $(basename "$tarball")"
}
vendored_sidecar registrar node-driver-registrar csi-node-driver-registrar \
    "$(value registrar repository)" "$(value registrar tag)"
vendored_sidecar livenessprobe livenessprobe livenessprobe \
    "$(value livenessprobe repository)" "$(value livenessprobe tag)"

snapshotter_repository=$(value snapshotter repository)
snapshotter_tag=$(value snapshotter tag)
controller_ref=${snapshotter_repository%/*}/snapshot-controller:$snapshotter_tag
sidecar snapshot-controller external-snapshotter "${controller_ref%:*}" "$snapshotter_tag"

# --- the snapshot CRDs and the snapshot-controller's deployment, from that release
major=${snapshotter_tag%%.*}
for what in crd snapshot-controller; do
    [ -d "$out/manifests/$what" ] && continue
    case $what in
        crd)
            src=$(module_field "github.com/kubernetes-csi/external-snapshotter/client/$major@$snapshotter_tag" Dir)/config/crd ;;
        snapshot-controller)
            src=$(module_field "github.com/kubernetes-csi/external-snapshotter/$major@$snapshotter_tag" Dir)/deploy/kubernetes/snapshot-controller ;;
    esac
    mkdir -p "$work/manifests"
    # kustomization.yaml only lists the others
    find "$src" -maxdepth 1 -name '*.yaml' ! -name kustomization.yaml -exec cp {} "$work/manifests/" \;
    chmod 0644 "$work/manifests"/*.yaml
    if [ "$what" = snapshot-controller ]; then
        # The release's Deployment names the previous release's image (v8.6.0's
        # names v8.5.0): it is made to name the controller built above.
        sed -i "s|^\(\s*image: \).*/snapshot-controller:.*$|\1$controller_ref|" \
            "$work/manifests/setup-snapshot-controller.yaml"
        [ "$(grep -c "image: $controller_ref$" "$work/manifests/setup-snapshot-controller.yaml")" = 1 ] ||
            die "no snapshot-controller image to set in setup-snapshot-controller.yaml"
    fi
    mkdir -p "$out/manifests"
    mv "$work/manifests" "$out/manifests/$what"
    echo "build-images: manifests/$what ($(ls "$out/manifests/$what" | wc -l) files from $src)"
done

for line in "${index[@]}"; do
    read -r role ref <<<"$line"
    echo "$role $ref $ref.tar"
done > "$work/images.txt"
mv "$work/images.txt" "$out/images.txt"
echo "build-images: $(wc -l < "$out/images.txt") images in $out"
