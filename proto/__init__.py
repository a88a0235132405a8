"""Sluice's gRPC contracts (package ``sluice.v1``) and their committed Python stubs."""
