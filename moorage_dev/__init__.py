"""The developer's tools: ``moorage demo`` and ``moorage dev`` (a real
Kubernetes on this machine for the end-to-end tests and the conformance
suite).  They ship with a source checkout, never in the container image, and
no package of the product imports them."""
