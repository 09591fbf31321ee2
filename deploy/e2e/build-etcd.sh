#!/usr/bin/env bash
# Build etcd and etcdctl from their Go modules:
#   deploy/e2e/build-etcd.sh VERSION OUTDIR [GO]
# `go install go.etcd.io/etcd/server/v3@VERSION` is refused: etcd's go.mod
# files replace their sibling modules (api, client, pkg) by ../ paths, which
# only exist in etcd's own repository.  A throwaway module that requires the
# server and etcdctl gets those siblings at the versions the server requires
# (the same release), so nothing needs replacing.  Static (CGO_ENABLED=0), as
# etcd's own release build is.
set -euo pipefail
version=${1:?usage: build-etcd.sh VERSION OUTDIR [GO]}
out=${2:?usage: build-etcd.sh VERSION OUTDIR [GO]}
go=${3:-go}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GOFLAGS=-mod=mod

cat > "$work/go.mod" <<EOF
module moorage.dev/e2e-etcd

go 1.24.0

require (
	go.etcd.io/etcd/server/v3 $version
	go.etcd.io/etcd/etcdctl/v3 $version
)
EOF
cat > "$work/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "go.etcd.io/etcd/etcdctl/v3"
	_ "go.etcd.io/etcd/server/v3"
)
GO
mkdir -p "$out"
(cd "$work" && "$go" mod tidy >/dev/null &&
    CGO_ENABLED=0 "$go" build -trimpath -o "$out/etcd" go.etcd.io/etcd/server/v3 &&
    CGO_ENABLED=0 "$go" build -trimpath -o "$out/etcdctl" go.etcd.io/etcd/etcdctl/v3)
# the server must be the release asked for, not whatever the module graph chose
grep -qx "etcd Version: ${version#v}" <<<"$("$out/etcd" --version)" ||
    { echo "build-etcd: $out/etcd is not $version: $("$out/etcd" --version | head -1)" >&2; exit 1; }
echo "build-etcd: $version in $out"
