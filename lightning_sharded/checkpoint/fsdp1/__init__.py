"""FSDP1's sharded state dicts without communication: views of the local flat shard, not gathered chunks.

For ``SHARDED_STATE_DICT`` torch's ``FullyShardedDataParallel`` all-gathers every flat parameter
(``model.state_dict()``: unshard, then clone each rank's dim-0 chunk into a ``ShardedTensor``) and every
optimizer state (``FSDP.optim_state_dict``: all-gather, then re-chunk), and loading reverses both with
further all-gathers. On a 2 GB model plus Adam that was most of a save and of a resume.

With ``use_orig_params=True`` (Lightning's default), each rank already holds, for every original
parameter, a contiguous piece of its flattened values (``FlatParameter._shard_param_infos``) and the
optimizer state of that piece. A contiguous range of a row-major tensor is a union of at most
``2 * ndim - 1`` boxes (a partial first row, full rows, a partial last row, recursively), so it is a
``ShardedTensor`` with several local shards, each a view of the local memory. Every rank computes every
other rank's boxes from the flat parameter's layout, so the ``ShardedTensor``'s global metadata needs no
collective. DCP writes those boxes as chunks (a checkpoint with the same keys, global shapes and dtypes
as torch's path: only the chunk boundaries differ, which every DCP reader reslices), and loads into
them in place: the bytes land in the flat parameter and in the optimizer state directly.

Used by :mod:`~lightning_sharded.checkpoint.state_dicts` and the sharded load when :func:`supported`
says the model fits (every FSDP unit ``FULL_SHARD`` or ``SHARD_GRAD_OP``, ``use_orig_params=True``, no
shared parameters, no device mesh); anything else takes torch's path.
"""

from lightning_sharded.checkpoint.fsdp1.layout import supported
from lightning_sharded.checkpoint.fsdp1.optimizer import optimizer_state_views, optimizer_template
from lightning_sharded.checkpoint.fsdp1.views import views

__all__ = ["optimizer_state_views", "optimizer_template", "supported", "views"]
