"""deploy/: the Helm chart, the plain manifests rendered from it, and the examples.

helm is built from its Go module by ``make tools`` (version pinned in the
Makefile); the Kubernetes schemas come from the kubernetes-validate package
(the e2e adds a real API server's dry run).  The sidecars' own RBAC files are
read from their Go modules, at the versions the chart's images name.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from csi.health import PROBE_TIMEOUT as HEALTHZ_PROBE_TIMEOUT
from tests.chart_render import CHART, KUBE_VERSION, objects, render, render_error, run_helm
from tests.conftest import REPO, go_module_dir

MANIFESTS = REPO / "deploy" / "kubernetes" / "moorage.yaml"
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
# Kinds from CRDs (external-snapshotter, prometheus-operator): no schema in the package
CRD_KINDS = {
    "VolumeSnapshotClass",
    "VolumeSnapshot",
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
}
# Each sidecar's module and the file its repository grants its ClusterRole in.
RBAC = "deploy/kubernetes/rbac.yaml"
SIDECAR_RBAC = {
    "provisioner": ("github.com/kubernetes-csi/external-provisioner/v6", RBAC),
    "attacher": ("github.com/kubernetes-csi/external-attacher/v4", RBAC),
    "resizer": ("github.com/kubernetes-csi/external-resizer/v2", RBAC),
    "snapshotter": (
        "github.com/kubernetes-csi/external-snapshotter/v8",
        "deploy/kubernetes/csi-snapshotter/rbac-csi-snapshotter.yaml",
    ),
}  # fmt: skip
NON_DEFAULT = {
    "kubeletDir": "/data/kubelet",
    "backendToken": {"create": True, "token": "0123456789abcdef0123"},
    "controller": {"replicas": 3},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "storageNode": {"topology": {"topology.csi.moorage.dev/zone": "a"}, "loopPoolSize": ""},
}
# Neither helper sidecar: the plugin registers itself and serves its own /healthz.
NO_SIDECARS = {
    "kubeletDir": "/data/kubelet",
    "sidecars": {"registrar": False, "livenessprobe": False},
}
# Flags by which a container listens on a port (the last ":"-part of the value).
LISTEN_FLAGS = {
    "--http-endpoint", "--metrics-address", "--health-address",  # sidecars and the plugin
    "--listen", "--nbd-listen", "--nfs-port", "--mount-port", "--metrics-listen",  # storage node
}  # fmt: skip


def find(objs: list[dict[str, Any]], kind: str, name_part: str = "") -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and name_part in o["metadata"]["name"]]
    assert len(found) == 1, f"{kind} *{name_part}*: {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(pod_owner: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod_owner["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return objects(render(None, tmp_path_factory.mktemp("default")))


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return objects(render(NON_DEFAULT, tmp_path_factory.mktemp("custom")))


@pytest.fixture(scope="module")
def no_sidecars(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return objects(render(NO_SIDECARS, tmp_path_factory.mktemp("no-sidecars")))


# ------------------------------------------------------------ the chart itself


@pytest.mark.parametrize(
    "values", [None, NON_DEFAULT, NO_SIDECARS], ids=["default", "non-default", "no-sidecars"]
)
def test_helm_lint_passes(values: dict[str, Any] | None, tmp_path: Path) -> None:
    extra = []
    if values is not None:
        (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
        extra = ["--values", str(tmp_path / "v.yaml")]
    out = run_helm("lint", str(CHART), "--kube-version", KUBE_VERSION, *extra)
    assert "0 chart(s) failed" in out, out


def test_plain_manifests_are_the_chart_rendered(tmp_path: Path) -> None:
    rendered = objects(render(None, tmp_path))
    committed = objects(MANIFESTS.read_text())
    assert committed == rendered, "deploy/kubernetes is out of date: run 'make manifests'"


def validate(docs: Iterator[dict[str, Any]] | list[dict[str, Any]], where: str) -> None:
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in CRD_KINDS, f"{where}: no schema for {doc['kind']}"
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{where}: {doc['kind']} {doc['metadata']['name']}: {e}") from e


def test_every_object_passes_the_kubernetes_schemas(
    default: list[dict[str, Any]], custom: list[dict[str, Any]], no_sidecars: list[dict[str, Any]]
) -> None:
    validate(default, "chart (default values)")
    validate(custom, "chart (non-default values)")
    validate(no_sidecars, "chart (no helper sidecars)")
    for example in EXAMPLES:
        validate(objects(example.read_text()), example.name)
    assert len(EXAMPLES) == 7


def test_the_csidriver_is_the_one_the_plugin_serves(default: list[dict[str, Any]]) -> None:
    spec = find(default, "CSIDriver")["spec"]
    assert spec == {
        "attachRequired": True,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Persistent", "Ephemeral"],
        "fsGroupPolicy": "File",
        "storageCapacity": True,
        "requiresRepublish": False,
        # kubelet calls NodeGetInfo this often for CSINode's count (MutableCSINodeAllocatableCount)
        "nodeAllocatableUpdatePeriodSeconds": 60,
    }


@pytest.mark.parametrize("period", [10, 300, 0, None])
def test_the_allocatable_update_period_comes_from_the_values(
    period: int | None, tmp_path: Path
) -> None:
    """0 or null: no field, so kubelet reads the count once, at registration."""
    values = {"csiDriver": {"nodeAllocatableUpdatePeriodSeconds": period}}
    spec = find(objects(render(values, tmp_path)), "CSIDriver")["spec"]
    assert spec.get("nodeAllocatableUpdatePeriodSeconds") == (period or None)


@pytest.mark.parametrize("period", [9, -60, 12.5, "60", True])
def test_an_allocatable_update_period_kubernetes_refuses_fails_the_render(
    period: object, tmp_path: Path
) -> None:
    """The API server's own rule (at least 10 s, a whole number) checked at render time."""
    assert "nodeAllocatableUpdatePeriodSeconds must be a whole number of seconds" in render_error(
        {"csiDriver": {"nodeAllocatableUpdatePeriodSeconds": period}}, tmp_path
    )


def test_fs_types_come_from_the_classes_not_a_provisioner_default(
    default: list[dict[str, Any]],
) -> None:
    # a --default-fstype would be put in the NFS class's volumes too (refused)
    provisioner = container(find(default, "Deployment", "controller"), "csi-provisioner")
    assert flag(provisioner, "--default-fstype") is None
    classes = [o for o in default if o["kind"] == "StorageClass"]
    for sc in classes:
        fstype = sc["parameters"].get("csi.storage.k8s.io/fstype")
        if sc["parameters"]["type"] == "nbd":
            assert fstype in ("ext4", "xfs"), sc["metadata"]["name"]
        else:
            assert fstype is None, sc["metadata"]["name"]


@pytest.mark.parametrize("kubelet", ["/var/lib/kubelet", "/data/kubelet"])
def test_socket_paths_agree_between_registrar_plugin_and_kubelet(
    kubelet: str, default: list[dict[str, Any]], custom: list[dict[str, Any]]
) -> None:
    objs = default if kubelet == "/var/lib/kubelet" else custom
    node = find(objs, "DaemonSet", "moorage-node")
    volumes = {v["name"]: v for v in node["spec"]["template"]["spec"]["volumes"]}
    plugin_dir = volumes["plugin-dir"]["hostPath"]["path"]
    assert plugin_dir == f"{kubelet}/plugins/csi.moorage.dev"
    assert volumes["registration-dir"]["hostPath"]["path"] == f"{kubelet}/plugins_registry"
    registrar = container(node, "node-driver-registrar")
    assert f"--kubelet-registration-path={plugin_dir}/csi.sock" in registrar["args"]
    assert "--csi-address=/csi/csi.sock" in registrar["args"]
    plugin = container(node, "moorage")
    assert "--endpoint=unix:///csi/csi.sock" in plugin["args"]
    mounts = {m["name"]: m for m in plugin["volumeMounts"]}
    assert mounts["plugin-dir"]["mountPath"] == "/csi"
    assert mounts["kubelet-dir"]["mountPath"] == kubelet
    assert mounts["kubelet-dir"]["mountPropagation"] == "Bidirectional"
    assert plugin["securityContext"]["privileged"] is True
    assert node["spec"]["template"]["spec"]["hostPID"] is True
    env = {e["name"]: e for e in plugin["env"]}
    assert env["MOORAGE_FUSE_CGROUP"]["value"] == "moorage-fuse"


@pytest.mark.parametrize("kubelet", ["/var/lib/kubelet", "/data/kubelet"])
def test_the_node_plugin_checks_propagation_of_the_kubelet_dir_it_mounts(
    kubelet: str, default: list[dict[str, Any]], custom: list[dict[str, Any]]
) -> None:
    # the plugin refuses to start unless --kubelet-dir is shared where it runs:
    # the directory it checks is the one mounted Bidirectional, and no opt-out
    node = find(default if kubelet == "/var/lib/kubelet" else custom, "DaemonSet", "moorage-node")
    plugin = container(node, "moorage")
    assert flag(plugin, "--kubelet-dir") == kubelet
    assert not [a for a in plugin["args"] if a.startswith("--allow-private-mounts")]
    mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}
    assert mounts[kubelet]["mountPropagation"] == "Bidirectional"
    volumes = {v["name"]: v for v in node["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts[kubelet]["name"]]["hostPath"]["path"] == kubelet


def pod_images(objs: list[dict[str, Any]]) -> set[str]:
    images = set()
    for obj in objs:
        if obj["kind"] in ("Deployment", "DaemonSet"):
            spec = obj["spec"]["template"]["spec"]
            images |= {c["image"] for c in spec["containers"] + spec.get("initContainers", [])}
    return images


def test_images_are_pinned_in_one_place(default: list[dict[str, Any]]) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pinned = {f"{i['repository']}:{i['tag']}" for i in values["images"].values() if "tag" in i}
    used = pod_images(default)
    assert used <= pinned, used - pinned
    assert all(":" in image and not image.endswith(":latest") for image in used), used
    assert len(used) == 7  # moorage and six sidecars


def flag(c: dict[str, Any], name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in c.get("args", []) if a.startswith(name + "=")]
    assert len(values) <= 1, f"{c['name']}: {name} given {len(values)} times"
    return values[0] if values else None


def test_without_the_sidecars_the_node_plugin_registers_itself(
    no_sidecars: list[dict[str, Any]],
) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["images"]
    sidecar_images = {
        f"{values[k]['repository']}:{values[k]['tag']}" for k in ("registrar", "livenessprobe")
    }
    assert not pod_images(no_sidecars) & sidecar_images
    assert len(pod_images(no_sidecars)) == 5  # moorage and the four controller sidecars
    node = find(no_sidecars, "DaemonSet", "moorage-node")
    spec = node["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["moorage"]
    plugin = container(node, "moorage")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    # the registration socket goes where kubelet watches, on the host
    assert flag(plugin, "--registration-dir") == mounts["registration-dir"] == "/registration"
    assert volumes["registration-dir"]["hostPath"]["path"] == "/data/kubelet/plugins_registry"
    # kubelet is told the host's path of the socket the plugin serves in /csi
    host_socket = flag(plugin, "--kubelet-registration-path")
    assert host_socket == "/data/kubelet/plugins/csi.moorage.dev/csi.sock"
    assert host_socket == volumes["plugin-dir"]["hostPath"]["path"] + "/csi.sock"
    assert flag(plugin, "--endpoint") == "unix://" + mounts["plugin-dir"] + "/csi.sock"


@pytest.mark.parametrize("registrar", [True, False], ids=["registrar", "no-registrar"])
@pytest.mark.parametrize("probe", [True, False], ids=["livenessprobe", "no-livenessprobe"])
def test_each_sidecar_or_the_plugin_does_its_job_never_both(
    registrar: bool, probe: bool, tmp_path: Path
) -> None:
    objs = objects(render({"sidecars": {"registrar": registrar, "livenessprobe": probe}}, tmp_path))
    node = find(objs, "DaemonSet", "moorage-node")
    names = [c["name"] for c in node["spec"]["template"]["spec"]["containers"]]
    assert ("node-driver-registrar" in names) is registrar
    plugin = container(node, "moorage")
    assert (flag(plugin, "--registration-dir") is None) is registrar
    assert (flag(plugin, "--kubelet-registration-path") is None) is registrar
    assert ("registration-dir" in {m["name"] for m in plugin["volumeMounts"]}) is not registrar
    for owner in (node, find(objs, "Deployment", "moorage-controller")):
        spec = owner["spec"]["template"]["spec"]
        plugin = container(owner, "moorage")
        # the port the plugin container's livenessProbe calls ...
        port = plugin["livenessProbe"]["httpGet"]["port"]
        port = next(p["containerPort"] for p in plugin["ports"] if p["name"] == port)
        # ... is served by the livenessprobe sidecar, or by the plugin itself
        sidecars = [c for c in spec["containers"] if c["name"] == "liveness-probe"]
        assert len(sidecars) == (1 if probe else 0), owner["metadata"]["name"]
        if probe:
            assert flag(sidecars[0], "--http-endpoint") == f":{port}"
            assert flag(plugin, "--health-address") is None
        else:
            assert flag(plugin, "--health-address") == f"0.0.0.0:{port}"


def pod_specs(objs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objs:
        spec = obj.get("spec", {}).get("template", {}).get("spec")
        if spec is not None:
            yield obj["metadata"]["name"], spec


@pytest.mark.parametrize("which", ["default", "custom", "no_sidecars"])
def test_every_probe_sets_its_timeout_and_liveness_its_period_and_threshold(
    which: str, request: pytest.FixtureRequest
) -> None:
    """kubelet's defaults (a 1 s timeout, 3 failures 10 s apart) restart a busy plugin."""
    objs: list[dict[str, Any]] = request.getfixturevalue(which)
    seen = 0
    for owner, spec in pod_specs(objs):
        for c in spec["containers"] + spec.get("initContainers", []):
            for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
                if kind not in c:
                    continue
                seen += 1
                where = f"{owner}/{c['name']} {kind}"
                assert c[kind].get("timeoutSeconds", 0) >= 2, f"{where}: no timeoutSeconds"
                if kind == "livenessProbe":
                    assert "periodSeconds" in c[kind], f"{where}: no periodSeconds"
                    assert "failureThreshold" in c[kind], f"{where}: no failureThreshold"
            # whoever answers /healthz gives up on the Probe before kubelet gives up on it
            if c["name"] == "moorage" and "livenessProbe" in c:
                sidecars = [x for x in spec["containers"] if x["name"] == "liveness-probe"]
                limit = c["livenessProbe"]["timeoutSeconds"]
                if sidecars:
                    timeout = flag(sidecars[0], "--probe-timeout")
                    assert timeout is not None and timeout.endswith("s"), owner
                    assert float(timeout[:-1]) < limit, owner
                else:
                    assert limit > HEALTHZ_PROBE_TIMEOUT, owner
    assert seen >= 3  # the controller's, the node plugin's, the storage node's


@pytest.mark.parametrize("values", [None, NO_SIDECARS], ids=["default", "no-sidecars"])
def test_ports_on_the_host_network_do_not_clash(
    values: dict[str, Any] | None, tmp_path: Path
) -> None:
    owners: dict[int, list[str]] = {}
    for obj in objects(render(values, tmp_path)):
        if obj["kind"] != "DaemonSet":
            continue
        spec = obj["spec"]["template"]["spec"]
        assert spec.get("hostNetwork") is True, obj["metadata"]["name"]
        for c in spec["containers"]:
            for name in LISTEN_FLAGS:
                value = flag(c, name)
                if value is not None:
                    port = int(value.rsplit(":", 1)[-1])
                    owners.setdefault(port, []).append(f"{c['name']} {name}")
    clashes = {port: who for port, who in owners.items() if len(who) > 1}
    assert not clashes, clashes
    assert {9809, 9899, 7443, 10809, 2049, 20048, 9810} <= owners.keys()


def sidecar_rules(kind: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    """The ClusterRole rules of a sidecar's own rbac.yaml, at the chart's version."""
    module, path = SIDECAR_RBAC[kind]
    tag = values["images"][kind]["tag"]
    source = go_module_dir(f"{module}@{tag}") / path
    roles = [d for d in yaml.safe_load_all(source.read_text()) if d and d["kind"] == "ClusterRole"]
    assert roles, f"no ClusterRole in {source}"
    return [rule for role in roles for rule in role["rules"]]


def grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for r in rules
        for group in r.get("apiGroups", [""])
        for resource in r.get("resources", [])
        for verb in r.get("verbs", [])
    }


@pytest.mark.parametrize("kind", list(SIDECAR_RBAC))
def test_each_sidecar_gets_what_its_own_rbac_grants(
    kind: str, default: list[dict[str, Any]]
) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    needed = grants(sidecar_rules(kind, values))
    ours = grants(find(default, "ClusterRole", f"-{kind}")["rules"])
    if kind == "provisioner":  # its namespaced needs live in our Role
        ours |= grants(find(default, "Role", "-provisioner")["rules"])
    missing = sorted(needed - ours)
    assert not missing, f"{kind}: missing {missing}"


# ------------------------------------------------- the storage node's host paths


def host_path_of(pod_owner: dict[str, Any], c: dict[str, Any], path: str) -> str | None:
    """Where ``path`` in container ``c`` is on the host: through the deepest mount over
    it, when that is a hostPath volume (None: in the container's own layer, or not a
    hostPath volume)."""
    over = [
        m
        for m in c.get("volumeMounts", [])
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    if not over:
        return None
    mount = max(over, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in pod_owner["spec"]["template"]["spec"]["volumes"]}
    host = volumes[mount["name"]].get("hostPath")
    if host is None:
        return None
    base: str = host["path"].rstrip("/")
    return base + path[len(mount["mountPath"].rstrip("/")) :]


@pytest.mark.parametrize(
    "paths",
    [
        {},
        {"dataHostPath": "/srv/moorage-catalog", "poolHostPath": "/mnt/disks/pool1/pool"},
        {"dataHostPath": "/data/moorage/catalog/", "poolHostPath": "/data/moorage/pool"},
        {"dataHostPath": "/var/lib/moorage-data", "poolHostPath": "/var/lib/moorage/pool"},
    ],
    ids=["default", "data-elsewhere", "data-beside-the-pool", "data-a-sibling-by-prefix"],
)
def test_every_host_path_of_the_storage_node_is_a_host_path_volume(
    paths: dict[str, str],
) -> None:
    sets = [f"--set=storageNode.{key}={value}" for key, value in paths.items()]
    objs = objects(
        run_helm(
            "template", "moorage", str(CHART), "--namespace", "moorage-system",
            "--kube-version", KUBE_VERSION, *sets,
        )
    )  # fmt: skip
    daemonset = find(objs, "DaemonSet", "-storage-node")
    backend = container(daemonset, "backend")
    data_dir, pool = flag(backend, "--data-dir"), flag(backend, "--pool")
    assert data_dir and pool
    if paths:
        assert data_dir.rstrip("/") == paths["dataHostPath"].rstrip("/")
        assert pool == paths["poolHostPath"]
    # the catalog and ganesha's files; the pool, its loop image and its record
    for path in (data_dir, pool, f"{pool}.img", f"{pool}.pool.json", "/dev"):
        assert host_path_of(daemonset, backend, path) == path, f"{path} is not the host's"
    init = container(daemonset, "pool")
    for path in (pool, f"{pool}.img", f"{pool}.pool.json"):
        assert host_path_of(daemonset, init, path) == path, f"pool init: {path}"


@pytest.mark.parametrize("io_timeout", [None, 45])
def test_the_io_timeout_reaches_the_plugins_configuration(
    io_timeout: int | None, tmp_path: Path
) -> None:
    from csi.config import parse_config

    values = None if io_timeout is None else {"node": {"ioTimeout": io_timeout}}
    config_map = find(objects(render(values, tmp_path)), "ConfigMap", "csi-config")
    config = parse_config(tomllib.loads(config_map["data"]["csi.toml"]))
    assert config.node.io_timeout == (120 if io_timeout is None else io_timeout)


@pytest.mark.parametrize("mib", [None, 1, 256, 1048576])
def test_the_fuse_attachment_budget_reaches_the_plugins_configuration(
    mib: int | None, tmp_path: Path
) -> None:
    from csi.config import parse_config

    values = None if mib is None else {"node": {"fuseAttachmentMiB": mib}}
    config_map = find(objects(render(values, tmp_path)), "ConfigMap", "csi-config")
    config = parse_config(tomllib.loads(config_map["data"]["csi.toml"]))
    assert config.node.fuse_attachment_mib == (64 if mib is None else mib)


@pytest.mark.parametrize("mib", [0, -64, 64.5, "64Mi", "64", True, None, 1048577])
def test_a_fuse_attachment_budget_the_plugin_refuses_fails_the_render(
    mib: object, tmp_path: Path
) -> None:
    """The plugin's own rule (csi.config: a whole number of MiB, 1 to 1048576)
    checked at render time, rather than a node plugin that crash-loops."""
    assert "node.fuseAttachmentMiB must be a whole number of MiB" in render_error(
        {"node": {"fuseAttachmentMiB": mib}}, tmp_path
    )


@pytest.mark.parametrize("devices", [None, 0, 64, 65536])
def test_the_nbd_pool_reaches_the_plugins_configuration(
    devices: int | None, tmp_path: Path
) -> None:
    from csi.config import parse_config

    values = None if devices is None else {"node": {"nbdDevices": devices}}
    config_map = find(objects(render(values, tmp_path)), "ConfigMap", "csi-config")
    config = parse_config(tomllib.loads(config_map["data"]["csi.toml"]))
    assert config.node.nbd_devices == (devices or 0)


@pytest.mark.parametrize("devices", [-1, 16.5, "16", True, None, 65537])
def test_an_nbd_pool_the_plugin_refuses_fails_the_render(devices: object, tmp_path: Path) -> None:
    assert "node.nbdDevices must be a whole number" in render_error(
        {"node": {"nbdDevices": devices}}, tmp_path
    )


def test_the_nfs_class_leaves_the_bound_to_the_node(default: list[dict[str, Any]]) -> None:
    """`hard` (or soft/timeo/retrans) in a class's mountOptions replaces the node's bound:
    a kernel NFS mount would then wait for ever on a storage node that is gone."""
    nfs = find(default, "StorageClass", "moorage-nfs")
    keys = {o.split("=", 1)[0] for o in nfs.get("mountOptions", [])}
    assert not keys & {"hard", "soft", "softerr", "timeo", "retrans"}, nfs["mountOptions"]
