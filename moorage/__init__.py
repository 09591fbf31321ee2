"""The ``moorage`` command line, and the development cluster behind ``moorage dev``.

Each command turns its options into a call of the package that does the
work (the NBD server, the storage node, the CSI plugin, the attach
mechanics) and reports the outcome by the conventions of ``moorage.output``.
"""
