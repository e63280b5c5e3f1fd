"""fly-comm: a custom all-reduce across the GPUs of one host, written in FlyDSL.

``CustomAllReduce(group, max_size=...)`` registers buffers that every rank of a ``torch.distributed``
group on one host can address (torch's symmetric memory, or CUDA IPC), once; ``all_reduce(t, op="sum",
out=None)`` then sums bf16 / fp16 / fp32 tensors over the ranks with a one-shot or a two-shot kernel, or
with ``torch.distributed.all_reduce`` where those would not win (:func:`choose_algorithm`). CPU tensors
go to ``torch.distributed`` (gloo), so CPU jobs run the API end to end. See the package README for the
status: the GPU paths are written but have not run yet (they need a machine with two or more GPUs).
"""

from ._version import __version__
from .algorithm import ALGORITHMS, DEFAULT_CUTOFFS, WORLD_SIZES, choose_algorithm, default_cutoffs
from .allreduce import DEFAULT_MAX_SIZE, DTYPES, OPS, CustomAllReduce
from .layout import BufferLayout, slice_range, two_shot_slice

__all__ = [
    "__version__", "CustomAllReduce", "choose_algorithm", "default_cutoffs", "DEFAULT_CUTOFFS", "ALGORITHMS",
    "WORLD_SIZES", "DTYPES", "OPS", "DEFAULT_MAX_SIZE", "BufferLayout", "two_shot_slice", "slice_range",
]  # fmt: skip
