"""Process groups and collectives for tensor and pipeline parallelism (torch.distributed)."""
from engine.distributed.parallel_state import ParallelContext, init_parallel, stage_layers

__all__ = ["ParallelContext", "init_parallel", "stage_layers"]
