"""Test-wide settings, applied before torch is imported anywhere (also inherited by spawned processes)."""

from __future__ import annotations

import os

# The suite runs several processes (tests, engine, tokenizer services, gateways) on 2 cores. OpenMP threads
# that spin while waiting for each other then starve everyone: sleep instead (measured 3-5x faster steps).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
