"""The one seam to torch's and Lightning's private names: every one the package uses is reached here.

The package supports torch 2.13 to 2.15 and Lightning 2.6.x (``pyproject.toml``; CI runs both ends of the
torch range). What it needs that neither offers publicly is imported (or, for a module the package must
not import itself, named) in this module and nowhere else: ``tests/test_compat.py`` fails for a private
torch or Lightning import anywhere else in the package, and for a name here that the installed torch or
Lightning no longer has. A branch on the version, where a release moves a name, goes here too.

Each name says, in its comment, what public API would replace it. Imports are made on first use (most of
these modules are slow to import, and ``ShardedTensor`` support must not be imported by the package on a
torch that deprecates it: :data:`SHARDED_TENSOR_MODULE` is looked up in ``sys.modules``).
"""

from __future__ import annotations

import importlib
from types import CodeType, FrameType, ModuleType
from typing import Any

# -- module paths looked up (never imported) by the package -------------------------------------------

#: ShardedTensor's module (``torch.distributed._shard``): no public home; DTensor replaces the type.
SHARDED_TENSOR_MODULE = "torch.distributed._shard.sharded_tensor.api"
#: ``ActivationWrapper``'s module (checkpoint wrappers): no public path; ``torch.utils.checkpoint`` has none.
CHECKPOINT_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
#: ``OptimizedModule`` (``torch.compile``'s wrapper): would be ``torch.compiler``'s if it exported the type.
DYNAMO_EVAL_FRAME_MODULE = "torch._dynamo.eval_frame"


# -- torch.distributed.checkpoint ------------------------------------------------------------------------


def create_file_view(file: Any, offset: int, length: int) -> Any:
    """A read-only view of ``length`` bytes of ``file`` from ``offset``, as DCP's readers make. Public
    replacement: none (``torch.distributed.checkpoint.utils._create_file_view``); a small ``io.RawIOBase`` of
    our own would do."""
    from torch.distributed.checkpoint.utils import _create_file_view

    return _create_file_view(file, offset, length)


def fsspec_filesystem() -> ModuleType:
    """torch's fsspec storage for DCP (``FileSystem``, ``FsspecReader``, ``FsspecWriter``). Public
    replacement: ``torch.distributed.checkpoint.FsspecReader``/``FsspecWriter`` where a torch exports them
    (2.13 to 2.15 do not; ``FileSystem`` has no public name in any)."""
    return importlib.import_module("torch.distributed.checkpoint._fsspec_filesystem")


def create_chunk_list(tensor: Any) -> Any:
    """The chunks DCP records for a tensor (DTensor, ShardedTensor or plain). Public replacement:
    ``tensor.__create_chunk_list__()`` where every kind has it (plain tensors do not)."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    return _create_chunk_list(tensor)


def flatten_state_dict(state: Any) -> Any:
    """DCP's flattening of a nested state dict: ``(flat, mapping)``. Public replacement: none
    (``DefaultSavePlanner(flatten_state_dict=True)`` does it inside a plan)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state)


def flatten_sharded_tensors(state: Any) -> Any:
    """DCP's flattening of nested ShardedTensors (as its planners do before planning). Public replacement:
    ``DefaultSavePlanner(flatten_sharded_tensors=True)`` inside a plan."""
    from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

    return _flatten_sharded_tensors(state)


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """The storage record a ``FileSystemWriter``'s write results carry (``_StorageInfo``). Public replacement:
    none; ``WriteResult.storage_data`` is typed ``Any``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def dcp_load_state_dict(state: Any, *, storage_reader: Any, planner: Any) -> None:
    """DCP's load into ``state`` in this process alone (no process group), with a planner of ours. Public
    replacement: ``torch.distributed.checkpoint.load(..., no_dist=True)`` does the same here (no ``Stateful``
    values) but warns on every call ("assuming the intent is to load in a single process"), and silencing that
    would change the process's warning filters (not thread-safe)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, storage_reader=storage_reader, planner=planner, no_dist=True)


# -- torch.distributed -----------------------------------------------------------------------------------


def object_collective_device(group: Any) -> Any:
    """The device torch's object collectives use on ``group`` (CPU on gloo, the current CUDA one on NCCL).
    Public replacement: none; ``torch.distributed.get_backend(group)`` and a rule of our own would do."""
    from torch.distributed.distributed_c10d import _get_object_coll_device

    return _get_object_coll_device(group)


def default_store() -> Any:
    """The default process group's store. Public replacement: none (a ``TCPStore`` of our own, at the cost of
    a port)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def gather_state_dict(state: dict[str, Any], *, ranks_only: tuple[int, ...]) -> dict[str, Any]:
    """A state dict whose sharded values (DTensor, ShardedTensor) are gathered onto ``ranks_only``. Public
    replacement: ``get_model_state_dict(..., options=StateDictOptions(full_state_dict=True))`` for a whole
    model (which FSDP1 on CPU does not support with sharded attributes beside it)."""
    from torch.distributed._state_dict_utils import _gather_state_dict

    return _gather_state_dict(state, cpu_offload=False, ranks_only=ranks_only)  # type: ignore[no-any-return]


def strided_shard() -> Any:
    """DTensor's ``_StridedShard`` placement (FSDP2 over tensor parallelism). Public replacement: none in 2.13
    to 2.15 (``torch.distributed.tensor.placement_types``)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def sharded_tensor_api() -> Any:
    """The ``ShardedTensor`` classes: ``(ShardedTensor, Shard, ShardMetadata, ShardedTensorMetadata,
    TensorProperties)``. Imported on use only (a package that makes ShardedTensors has imported them). Public
    replacement: none (``torch.distributed._shard``, deprecated for DTensor)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharded_tensor.shard import Shard

    return ShardedTensor, Shard, ShardMetadata, ShardedTensorMetadata, TensorProperties


def fsdp1_state_dict_utils() -> ModuleType:
    """FSDP1's state-dict hook module, whose steps :mod:`~lightning_sharded.checkpoint.fsdp1.views` reuses.
    Public replacement: none (FSDP1's ``SHARDED_STATE_DICT`` through ``state_dict()`` gathers nothing but
    copies; FSDP2 replaces FSDP1)."""
    return importlib.import_module("torch.distributed.fsdp._state_dict_utils")


def fsdp1_names() -> tuple[str, str]:
    """``(FSDP_PREFIX, FLAT_PARAM)``: FSDP1's wrapper prefix (``"_fsdp_wrapped_module."``) and flat
    parameter name. Public replacement: none."""
    from torch.distributed.fsdp._common_utils import FSDP_PREFIX
    from torch.distributed.fsdp._unshard_param_utils import FLAT_PARAM

    return FSDP_PREFIX, FLAT_PARAM


# -- Lightning --------------------------------------------------------------------------------------------


def materialize_distributed_module(module: Any, device: Any) -> None:
    """Lightning's materialization of a model's meta-device parameters after ``fully_shard``/TP. Public
    replacement: none in Lightning 2.6 (``lightning.fabric.utilities.init``); used by
    ``ShardedModelParallelStrategy.setup`` until it can call stock's (see docs/strategies.md)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Lightning's move of the optimizers' state to ``device``. Public replacement: none in Lightning 2.6
    (``lightning.fabric.utilities.optimizer``)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def load_module_from(
    cls: Any, checkpoint: dict[str, Any], path: Any, hparams_file: Any, strict: bool | None, **kwargs: Any
) -> Any:
    """Lightning's ``cls.load_from_checkpoint(path, ...)`` of a checkpoint dict already read: what
    ``lightning.pytorch.core.saving._load_from_checkpoint`` does after its read (migration, ``hparams_file``
    and ``kwargs`` over the saved hyperparameters, the model built and loaded, moved to its state's device).
    Public replacement: none in Lightning 2.6 (``load_from_checkpoint`` reads the checkpoint itself, through
    the module-level ``pl_load``)."""
    import torch
    from lightning.pytorch.core.saving import _load_state, load_hparams_from_tags_csv, load_hparams_from_yaml
    from lightning.pytorch.utilities import rank_zero_warn
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    if hparams_file is not None:
        extension = str(hparams_file).split(".")[-1].lower()
        if extension not in ("csv", "yml", "yaml"):
            raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
        read = load_hparams_from_tags_csv if extension == "csv" else load_hparams_from_yaml
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = read(hparams_file)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
    model: Any = _load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint["state_dict"]
    if not state_dict:
        rank_zero_warn(f"The state dict in {path!r} contains no parameters.")
        return model
    return model.to(
        next((t for t in state_dict.values() if isinstance(t, torch.Tensor)), torch.tensor(0)).device
    )


# -- nn.Module.load_state_dict's arguments, read from its frames ----------------------------------------
# torch hands a load_state_dict post-hook neither ``strict`` nor ``assign`` nor the load's whole state
# dict, and its pre-hooks ``strict=True`` whatever the caller asked: the hooks read them from the frames of
# the running call (torch 2.13 to 2.15: ``Module.load_state_dict(self, state_dict, strict, assign)``
# nests ``load(module, local_state_dict, prefix)``). Public replacement: none in 2.13 to 2.15 (the pre-hook
# has ``assign`` as ``local_metadata["assign_to_params_buffers"]``, nothing has ``strict``). The locals are
# checked once (:func:`load_frames`): a torch that renames them fails every load loudly, never guesses.

#: The locals each code object must have: ``load_state_dict``'s and its nested ``load``'s.
LOAD_LOCALS = ("self", "state_dict", "strict", "assign")
LOAD_INNER_LOCALS = ("module", "prefix")
_load_frames: tuple[CodeType, CodeType] | None = None


def load_frames() -> tuple[CodeType, CodeType]:
    """The code objects of ``nn.Module.load_state_dict`` and of the ``load`` it nests, checked.

    Raises:
        RuntimeError: this torch's ``load_state_dict`` lacks a local the hooks read, or nests no ``load``.
    """
    global _load_frames
    if _load_frames is None:
        import torch
        import torch.nn as nn

        outer = nn.Module.load_state_dict.__code__
        inner = next((c for c in outer.co_consts if isinstance(c, CodeType) and c.co_name == "load"), None)
        missing = [n for n in LOAD_LOCALS if n not in outer.co_varnames]
        if inner is None:
            missing.append("a nested `load`")
        else:
            missing += [f"load's {n}" for n in LOAD_INNER_LOCALS if n not in inner.co_varnames]
        if missing or inner is None:
            raise RuntimeError(
                f"torch {torch.__version__}'s nn.Module.load_state_dict has no {', '.join(missing)}:"
                " lightning_sharded's state-dict hooks read the caller's `strict`, `assign` and state dict"
                " there (torch 2.13 to 2.15). Install a supported torch (the README lists them)."
            )
        _load_frames = (outer, inner)
    return _load_frames


def load_call(frame: FrameType | None) -> tuple[bool, bool, Any]:
    """``(strict, assign, state_dict)`` of the ``nn.Module.load_state_dict`` call running at or above
    ``frame``; ``(True, False, None)`` without one (``_load_from_state_dict`` called directly)."""
    outer, _ = load_frames()
    while frame is not None:
        if frame.f_code is outer:
            local = frame.f_locals
            return bool(local["strict"]), bool(local["assign"]), local["state_dict"]
        frame = frame.f_back
    return True, False, None


def running_load(module: Any, frame: FrameType | None) -> tuple[str, bool, bool, Any] | None:
    """``(prefix, strict, assign, state_dict)`` of the ``load_state_dict`` call loading ``module`` now:
    ``prefix`` is ``module``'s (from torch's recursion), the rest the caller's; ``None`` if torch's
    recursion is not on the stack."""
    outer, inner = load_frames()
    prefix = None
    while frame is not None:
        if prefix is None and frame.f_code is inner and frame.f_locals.get("module") is module:
            prefix = frame.f_locals["prefix"]
        elif frame.f_code is outer:
            local = frame.f_locals
            whole = local["state_dict"]
            if not isinstance(prefix, str) or not isinstance(whole, dict):
                return None
            return prefix, bool(local["strict"]), bool(local["assign"]), whole
        frame = frame.f_back
    return None
