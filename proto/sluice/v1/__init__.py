"""Stubs of ``package sluice.v1``: ``from proto.sluice.v1 import engine_pb2, engine_pb2_grpc``."""
