"""The one reader of a sharded checkpoint's ``meta.pt``: the rest of the Lightning checkpoint (epoch,
global step, loops, callbacks, hyperparameters...), which Lightning saves beside the DCP files. It
unpickles by the two rules of every pickle read (``docs/checkpoint-format.md``, Security): a resume's
and the offline tools'.
"""

from __future__ import annotations

import pickle
from typing import Any

from lightning_sharded.checkpoint import failures, unpickling
from lightning_sharded.checkpoint.backends import Backend, Location, parent
from lightning_sharded.checkpoint.errors import CheckpointError

__all__ = ["VERIFY_HINT", "read_meta", "refused"]

#: What the tools' errors about a damaged file tell to do.
VERIFY_HINT = "Run `lightning-sharded verify {path}` to find the damaged file."


def read_meta(
    backend: Backend, file: Location, weights_only: bool | None, *, safe: bool = False
) -> dict[str, Any]:
    """The Lightning metadata dict in ``meta.pt`` at ``file``, read through ``backend``.

    ``weights_only``: ``torch.load``'s, as ``fit()`` was given it (a resume's rule). With ``safe`` (the
    offline tools' rule), ``True`` or ``None`` reads with :func:`~.unpickling.safe_load` (a refused type
    raises :class:`~.unpickling.RefusedPickleError`, naming it), ``False`` unpickles anything.

    Raises:
        StorageError: the storage failed the read (permissions, an I/O error...).
        CheckpointError: it holds a type the load refuses (the message says what to do), does not read
            (truncated or corrupt), or is not a dict.
    """
    what = f"The Lightning metadata {str(file)!r}"
    try:
        if safe:
            metadata = unpickling.safe_load(
                file, what=what, weights_only=weights_only, load=backend.torch_load, map_location="cpu"
            )
        else:
            metadata = backend.torch_load(file, map_location="cpu", weights_only=weights_only)
    except CheckpointError:  # the tools' refusal of a type, named
        raise
    except pickle.UnpicklingError as ex:
        raise refused(what, ex, weights_only) from None
    except Exception as ex:
        storage = failures.read_failed(ex, f"the Lightning metadata {str(file)!r}")
        if storage is not None:
            raise storage from ex
        if safe:
            raise CheckpointError(
                f"{what} (epoch, global step, loops, callbacks) cannot be read ({type(ex).__name__}: {ex})."
                f" {VERIFY_HINT.format(path=parent(file))}"
            ) from ex
        raise CheckpointError(
            f"Could not read the Lightning metadata {str(file)!r}: {ex!r}. The file is truncated or corrupt;"
            " resume from an earlier checkpoint."
        ) from ex
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f"{what} holds a {type(metadata).__name__}, not a dict: this is not a Lightning checkpoint."
        )
    return metadata


def refused(what: str, ex: pickle.UnpicklingError, weights_only: bool | None) -> CheckpointError:
    """A resume's error for a pickle in ``what`` that ``torch.load`` refused: Lightning's rule, torch's
    ``weights_only`` as ``fit()`` was given it."""
    return CheckpointError(
        f"{what} holds {unpickling.refused_name(ex)}, which torch.load refuses with"
        f" weights_only={weights_only} (the default is torch's, True). If you trust the checkpoint (your"
        " own run), resume with trainer.fit(..., weights_only=False), as with stock Lightning."
    )
