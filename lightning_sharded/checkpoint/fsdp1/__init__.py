"""FSDP1's sharded state dicts without communication: views of the local flat shard, not gathered chunks.

torch's ``SHARDED_STATE_DICT`` all-gathers every flat parameter and optimizer state to save and again
to load: on a 2 GB model plus Adam, most of a save and of a resume. With ``use_orig_params=True`` each
rank holds a contiguous piece of every original parameter's flattening (at most ``2 * ndim - 1``
boxes, :mod:`~lightning_sharded.checkpoint.flat_ranges`) and its optimizer state, so each is a
``ShardedTensor`` of views whose global metadata every rank computes alone; DCP writes and reads the
boxes in place (``docs/checkpoint-format.md``, "Chunks of an FSDP1 checkpoint"; the measures:
``docs/benchmarks.md``). Used where :func:`supported` says the model fits (every unit ``FULL_SHARD`` or
``SHARD_GRAD_OP``, ``use_orig_params=True``, no shared parameters, no device mesh); else torch's path.
"""

from lightning_sharded.checkpoint.fsdp1.layout import supported
from lightning_sharded.checkpoint.fsdp1.optimizer import optimizer_state_views, optimizer_template
from lightning_sharded.checkpoint.fsdp1.views import views

__all__ = ["optimizer_state_views", "optimizer_template", "supported", "views"]
