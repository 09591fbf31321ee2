"""Host I/O that every layer of moorage needs, written once.

What the kernel and the host's tools say, and how a file or an address is
written, are facts shared by the NBD server, the FUSE processes, the storage
node, the CSI plugin and the command line: the mount table, a tool run in
the C locale, a file replaced atomically and durably, ``HOST:PORT`` and a
node's IP address, sizes, a tree of files given to a group.  This package
owns them and imports only the standard library, so any layer may import it
and none needs a copy of its own.
"""
