#!/usr/bin/env bash
# Check the e2e images (make e2e-tools) the way a node will use them:
#   deploy/e2e/check-images.sh [DIR]        (DIR: $MOORAGE_E2E_IMAGES)
# A containerd of its own (root, state and socket in a temporary directory;
# a host containerd is neither used nor touched) imports every archive listed
# in DIR/images.txt into the k8s.io namespace, as kubelet's containerd would
# see them, and runs each: the sidecars print their version, busybox's
# applets run, pause stays up until it is told to stop.  Everything it
# started is stopped and everything it mounted is unmounted on the way out.
set -euo pipefail
dir=${1:-${MOORAGE_E2E_IMAGES:?usage: check-images.sh DIR}}
[ -f "$dir/images.txt" ] || { echo "check-images: no $dir/images.txt (make e2e-tools)" >&2; exit 1; }
tmp=$(mktemp -d)
containerd_pid=""
cleanup() {
    if [ -n "$containerd_pid" ]; then
        kill -TERM "$containerd_pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$containerd_pid" 2>/dev/null || break; sleep 0.1; done
    fi
    # the shims' and snapshots' mounts under the private root, deepest first
    awk -v root="$tmp" 'index($2, root) == 1 { print $2 }' /proc/mounts | sort -r |
        while read -r m; do umount -l "$m" || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT

containerd --root "$tmp/root" --state "$tmp/state" --address "$tmp/containerd.sock" \
    > "$tmp/containerd.log" 2>&1 &
containerd_pid=$!
for _ in $(seq 300); do [ -S "$tmp/containerd.sock" ] && break; sleep 0.1; done
[ -S "$tmp/containerd.sock" ] || { cat "$tmp/containerd.log" >&2; exit 1; }
ctr=(ctr --address "$tmp/containerd.sock" -n k8s.io)

checked=0
# (grep -q reads from a here-string: in a pipe it would stop reading early and
# fail ctr with SIGPIPE, which pipefail reports)
task_is() { grep -q "^check-pause .*$1" <<<"$("${ctr[@]}" task ls)"; }
fail() { echo "check-images: $*" >&2; exit 1; }
# expect ID PATTERN ARGV...: a container that runs ARGV and prints PATTERN
expect() {
    local id=$1 pattern=$2 out
    shift 2
    out=$("${ctr[@]}" run --rm "$@" 2>&1) || fail "$id: $* failed: $out"
    grep -q -- "$pattern" <<<"$out" || fail "$id: $* printed no '$pattern': $out"
    echo "check-images: $id: $(head -1 <<<"$out")"
}

# fd 3: ctr run hands its own stdin to the container
while read -r role ref archive <&3; do
    "${ctr[@]}" images import "$dir/$archive" >/dev/null
    name=$ref
    [[ $ref == */* && ${ref%%/*} == *.* ]] || name=docker.io/library/$ref  # as containerd names it
    grep -qx "$name" <<<"$("${ctr[@]}" images ls -q)" || fail "$archive did not import as $name"
    tag=${ref##*:}
    case $role in
        pause)
            expect pause "pause.c v$tag" "$name" check-pause-v /pause -v
            # its own entrypoint and user; it must stay up until signalled
            "${ctr[@]}" run -d "$name" check-pause >/dev/null
            sleep 2
            task_is RUNNING || fail "pause is not running"
            "${ctr[@]}" task kill -s SIGTERM check-pause
            for _ in $(seq 50); do
                task_is STOPPED && break
                sleep 0.1
            done
            task_is STOPPED || fail "pause ignored SIGTERM"
            "${ctr[@]}" task rm check-pause >/dev/null
            "${ctr[@]}" containers rm check-pause
            echo "check-images: pause: ran until SIGTERM"
            ;;
        busybox)
            expect busybox "^hi$" "$name" check-busybox echo hi
            expect busybox-sh "^/bin/busybox$" "$name" check-busybox-sh sh -c 'readlink /bin/sh'
            ;;
        livenessprobe)
            # it has no --version flag (nor a version to stamp): its usage
            expect "$role-help" "Usage of /livenessprobe" "$name" "check-$role-help" /livenessprobe --help
            ;;
        agnhost)
            expect agnhost "^app version $tag$" "$name" check-agnhost /agnhost --version
            # the suite's host-exec pods run busybox's nsenter in it
            expect agnhost-nsenter "^/bin/busybox$" "$name" check-agnhost-nsenter readlink /usr/bin/nsenter
            ;;
        nginx)
            expect nginx "nginx version: nginx/" "$name" check-nginx nginx -v
            ;;
        jessie-dnsutils)
            expect jessie-dnsutils "^DiG " "$name" check-dnsutils dig -v
            ;;
        fio)
            expect fio "^fio-$tag" "$name" check-fio fio --version
            ;;
        *)
            command=${ref%:*}; command=/${command##*/}
            expect "$role" "$tag" "$name" "check-$role" "$command" --version
            expect "$role-help" "Usage of $command" "$name" "check-$role-help" "$command" --help
            ;;
    esac
    checked=$((checked + 1))
done 3< "$dir/images.txt"
echo "check-images: $checked images imported and run"
