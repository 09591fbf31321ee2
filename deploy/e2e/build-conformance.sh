#!/usr/bin/env bash
# Build Kubernetes' end-to-end test binary and the ginkgo that runs it in
# parallel, from the k8s.io/kubernetes Go module at the cluster's release:
#   deploy/e2e/build-conformance.sh VERSION OUTDIR [GO]
#   OUTDIR/e2e.test   `go test -c k8s.io/kubernetes/test/e2e`, the binary the
#                     External Storage suite runs from (-storage.testdriver)
#   OUTDIR/ginkgo     github.com/onsi/ginkgo/v2/ginkgo at the version that
#                     release's go.mod requires (the CLI must match the library)
#   OUTDIR/agnhost    test/images/agnhost, static: the suite's utility image
#                     (deploy/e2e/build-suite-images.sh packs it)
# The module is consumed as deploy/e2e/build-kubernetes.sh does: a throwaway
# module requires it and replaces each staging module by its published
# v0.MINOR.PATCH release.
set -euo pipefail
usage="usage: build-conformance.sh VERSION OUTDIR [GO]"
version=${1:?$usage}
out=${2:?$usage}
go=${3:-go}
staging_version="v0.${version#v1.}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GOFLAGS=-mod=mod

json=$("$go" mod download -json "k8s.io/kubernetes@$version")
modfile=$(sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p' <<<"$json")
kdir=$(sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p' <<<"$json")
[ -f "$modfile" ] || { echo "build-conformance: no go.mod for k8s.io/kubernetes@$version" >&2; exit 1; }
ginkgo_version=$(awk '$1 == "github.com/onsi/ginkgo/v2" { print $2; exit }' "$modfile")
[ -n "$ginkgo_version" ] || { echo "build-conformance: no ginkgo in $modfile" >&2; exit 1; }
{
    echo "module moorage.dev/e2e-conformance"
    echo
    echo "go 1.24.0"
    echo
    echo "require ("
    echo "	k8s.io/kubernetes $version"
    echo "	github.com/onsi/ginkgo/v2 $ginkgo_version"
    echo ")"
    echo
    echo "replace ("
    grep -E '=> \./staging/' "$modfile" | awk '{print $1}' | sort -u |
        while read -r module; do echo "	$module => $module $staging_version"; done
    echo ")"
} > "$work/go.mod"
cat > "$work/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "github.com/onsi/ginkgo/v2/ginkgo"
	_ "k8s.io/kubernetes/test/e2e"
	_ "k8s.io/kubernetes/test/images/agnhost"
)
GO
# the version e2e.test reports and compares with the server's, as a release stamps it
minor=${version#v1.}; minor=${minor%%.*}
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
mkdir -p "$out"
cd "$work"
"$go" mod tidy >/dev/null
"$go" test -c -trimpath -ldflags "$ldflags" -o "$out/e2e.test" k8s.io/kubernetes/test/e2e
"$go" build -trimpath -o "$out/ginkgo" github.com/onsi/ginkgo/v2/ginkgo
# agnhost's version as its image Makefile stamps it (test/images/agnhost/VERSION)
agnhost_version=$(cat "$kdir/test/images/agnhost/VERSION")
CGO_ENABLED=0 "$go" build -trimpath -ldflags "-X main.Version=$agnhost_version" \
    -o "$out/agnhost" k8s.io/kubernetes/test/images/agnhost
echo "build-conformance: e2e.test $version, agnhost and ginkgo $ginkgo_version in $out"
