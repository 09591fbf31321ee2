"""A real Kubernetes on this machine for moorage's end-to-end tests.

``moorage dev cluster up`` starts etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, containerd, kubelet and kube-proxy
(each built from its own release sources, see docs/e2e.md), with the
control plane in one network namespace and each node in another, joined by
a bridge inside the control plane's namespace: nothing is linked to the
host's interfaces.  It then imports the locally built images and installs
moorage with its Helm chart.  ``down`` undoes all of it.
"""
