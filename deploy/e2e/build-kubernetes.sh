#!/usr/bin/env bash
# Build Kubernetes' own components from the k8s.io/kubernetes Go module:
#   deploy/e2e/build-kubernetes.sh VERSION OUTDIR [GO]
# k8s.io/kubernetes is not meant to be a dependency: its go.mod points every
# k8s.io/* staging module at ./staging/src/..., which a module consumer does
# not have.  So a throwaway module requires it and replaces each staging
# module (the list read from that very go.mod) by its published v0.MINOR.PATCH
# release, then builds kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy and kubectl into OUTDIR.
set -euo pipefail
version=${1:?usage: build-kubernetes.sh VERSION OUTDIR [GO]}
out=${2:?usage: build-kubernetes.sh VERSION OUTDIR [GO]}
go=${3:-go}
staging_version="v0.${version#v1.}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GOFLAGS=-mod=mod

modfile=$("$go" mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p')
[ -f "$modfile" ] || { echo "build-kubernetes: no go.mod for k8s.io/kubernetes@$version" >&2; exit 1; }
{
    echo "module moorage.dev/e2e-kubernetes"
    echo
    echo "go 1.24.0"
    echo
    echo "require k8s.io/kubernetes $version"
    echo
    echo "replace ("
    grep -E '=> \./staging/' "$modfile" | awk '{print $1}' | sort -u |
        while read -r module; do echo "	$module => $module $staging_version"; done
    echo ")"
} > "$work/go.mod"
cat > "$work/tools.go" <<'GO'
//go:build tools

package tools

import _ "k8s.io/kubernetes/cmd/kubelet"
GO
# The version the components report (kubelet puts it in its Node object,
# kubectl and the API server compare theirs): what a release build stamps.
minor=${version#v1.}; minor=${minor%%.*}
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
mkdir -p "$out"
(cd "$work" && "$go" mod tidy >/dev/null && "$go" build -trimpath -ldflags "$ldflags" -o "$out/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy \
    k8s.io/kubernetes/cmd/kubectl)
echo "build-kubernetes: $version in $out"
