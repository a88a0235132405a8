"""Namespace of the ``sluice.*`` protobuf packages."""
