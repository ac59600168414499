"""The row store of a run whose every call is padded to one batch size (a fixed batch
shape, as :class:`divtrace.remedies.FixedBatch` applies it): the padding is cut off each
tensor before it is recorded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from divtrace.align.sites import Site
from divtrace.record.rows import RowStore

__all__ = ["PaddedStore"]


@dataclass
class PaddedStore(RowStore):
    """A :class:`RowStore` for passes padded to :attr:`size` rows, the real rows first:
    a tensor of ``size`` rows in a pass of fewer real rows keeps only those."""

    size: int = 0

    def pass_rows(self, start: int, stop: int) -> int:
        return max(self.size, stop - start)

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        shape = tensor.shape
        if shape and tensor.layout is torch.strided:
            dim = self.batch_dim % len(shape)
            if shape[dim] == self.size and self._chunk_len < self.size:
                tensor = tensor.narrow(dim, 0, self._chunk_len)
        super().on_tensor(site, tensor)
