"""Token embeddings: the whole table, or a tensor-parallel rank's rows of it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import ParallelContext


class Embedding(nn.Module):
    """A lookup table with no initialiser: nn.Embedding's normal_() on the meta device pulls in
    torch's Python decompositions, seconds of import time at every model load."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """A tensor-parallel rank's rows ``[vocab_start, vocab_start + num_embeddings)`` of the table (zero rows past
    the vocabulary): an id outside them looks up zeros here, and the ranks' lookups are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int, parallel: ParallelContext) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start
        self.parallel = parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))
