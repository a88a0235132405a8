"""Executors: how the core's ``SchedulerOutput`` reaches the workers (``uniproc``: one worker, this process)."""
