"""Processes started by ``sluice serve`` end when it does, even when it is SIGKILLed (Linux PR_SET_PDEATHSIG).

The supervisor passes its pid in ``SLUICE_PARENT_PID``; each child calls :func:`die_with_parent` first thing
in ``main``. Set in the child rather than in a ``preexec_fn``: Python code between fork and exec is unsafe
in a parent that already runs threads (the supervisor's gRPC health probes start some), and without a
``preexec_fn`` ``subprocess`` can use ``vfork``/``posix_spawn``.
"""
from __future__ import annotations

import ctypes
import os
import signal

ENV_PARENT_PID = "SLUICE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Ask the kernel for SIGTERM when the parent named in ``SLUICE_PARENT_PID`` exits; True when armed.

    If the parent is already gone (it died between spawning us and this call), SIGTERM ourselves now.
    """
    parent = os.environ.pop(ENV_PARENT_PID, None)
    if parent is None:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            return False
    except (OSError, AttributeError):  # not Linux / no glibc: nothing to arm
        return False
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)
    return True
