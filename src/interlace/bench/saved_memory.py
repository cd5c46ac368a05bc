"""Activation memory, measured as the bytes of the tensors autograd keeps for backward.

torch keeps no allocator statistics on CPU, so the `pipeline` and `planner` benchmarks count
what recomputation changes instead: `torch.autograd.graph.saved_tensors_hooks` sees every tensor an
operation saves for its backward. A saved tensor counts from the moment it is saved until
autograd releases it (after that node's backward), once per storage (q, k and v saving the
same input count it once), parameters excluded. Inside a checkpointed layer torch's own
checkpoint hooks take over, so such a layer counts only the input it keeps; the activations it
rebuilds during backward live for one layer's backward and are not counted. Not counted
either: parameters, gradients, optimizer state and transient buffers of an op. The hooks are
per thread; overlapped tensor parallelism carries them into its sub-batch threads
(`tp_interleave.run_interleaved`), so what those save is counted too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class SavedTensorMeter:
    """Live and peak bytes of saved activations while active (`with meter:`).

    exclude: tensors (parameters) whose storages are not counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return tensor
        count = self._refs.get(key, 0)
        self._refs[key] = count + 1
        if count == 0:
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return _Saved(tensor, key, storage.nbytes(), self)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= nbytes


class _Saved:
    """One saved tensor; autograd dropping it releases its count."""

    def __init__(self, tensor: torch.Tensor, key: int, nbytes: int, meter: SavedTensorMeter):
        self.tensor, self.key, self.nbytes, self.meter = tensor, key, nbytes, meter

    def __del__(self) -> None:
        self.meter._release(self.key, self.nbytes)
