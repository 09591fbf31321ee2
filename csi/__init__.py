"""The CSI plugin ``csi.moorage.dev``: its Identity, Controller and Node services,
the gRPC server they run in, and the node's attach, mount and state mechanics.

``moorage csi serve`` builds a :class:`csi.plugin.Plugin` and runs it.  This
package reaches storage nodes only through the backend's API client, and
never imports the command line.
"""
