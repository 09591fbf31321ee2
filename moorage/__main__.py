"""``python -m moorage``: the ``moorage`` command line."""

from moorage.cli import main

main()
