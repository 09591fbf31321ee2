"""Generated protobuf stubs, built from csi.proto (CSI) and pluginregistration.proto
(kubelet's plugin registration), never committed."""
