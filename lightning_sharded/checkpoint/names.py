"""File names, state keys and the grammar of sibling names of a checkpoint (standard library only, and
the manifest's name); the layout they make: ``docs/checkpoint-format.md``, "Layout of a sharded
directory". A save writes next to its target under hidden sibling names ``.<name>.<kind>-<token>``
(kinds :data:`STAGING`, :data:`OLD`, :data:`TRASH`); on object storage, versions live in
``data-<token>`` below the target. Tokens start with the time in hex, so they sort by creation.
"""

from __future__ import annotations

import re
import time
import uuid

from lightning_sharded.checkpoint.manifest import MANIFEST_NAME

__all__ = [
    "DATA_DIR",
    "DATA_PREFIX",
    "DCP_METADATA",
    "FROZEN_KEY",
    "INDEX_DIR",
    "INDEX_LAYOUT",
    "LIGHTNING_METADATA",
    "MANIFEST_NAME",
    "MODEL",
    "MODEL_KEYS",
    "OLD",
    "OPTIMIZER_KEY",
    "OPTIMIZER_STATES",
    "RANK_INDEX_FILE",
    "RANK_STATE_DIR",
    "RANK_STATE_FILE",
    "RANK_STATE_KEY",
    "SAFETENSORS_FILE",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SUFFIX",
    "SHARD_FILE",
    "SIBLING_KINDS",
    "STAGING",
    "STATE_DICT",
    "TRASH",
    "data_dir_name",
    "is_checkpoint_member",
    "optimizer_key",
    "owner_name",
    "rank_index_file",
    "rank_state_file",
    "shard_rank",
    "sibling_name",
    "sibling_pattern",
]

#: The index DCP writes last: every entry, and where its bytes are.
DCP_METADATA = ".metadata"
#: The file in which Lightning saves everything but model and optimizer state.
LIGHTNING_METADATA = "meta.pt"
#: Top-level key of the model state written by ``FSDPStrategy`` (stock and ours).
MODEL = "model"
#: Top-level key of the model state written by ``ModelParallelStrategy`` (stock and ours), and the key
#: of the model state in a full Lightning checkpoint file.
STATE_DICT = "state_dict"
#: Every top-level key a sharded directory may keep its model state under.
MODEL_KEYS = (STATE_DICT, MODEL)
#: Key of the list of optimizer states in a full Lightning checkpoint file.
OPTIMIZER_STATES = "optimizer_states"
#: Top-level DCP keys of the optimizers: ``optimizer_0``, ``optimizer_1``...
OPTIMIZER_KEY = re.compile(r"^optimizer_(\d+)$")
#: A DCP shard file, with the rank that wrote it.
SHARD_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
#: Name prefix of one version of a sharded checkpoint on object storage.
DATA_PREFIX = "data-"
#: A version directory on object storage.
DATA_DIR = re.compile(rf"^{DATA_PREFIX}[0-9a-f]{{24}}$")

#: Folder of a sharded directory with one file per rank: that rank's RNG and train dataloader state.
RANK_STATE_DIR = "rank_state"
#: One rank's file in :data:`RANK_STATE_DIR`, with the rank that wrote it.
RANK_STATE_FILE = re.compile(rf"^{RANK_STATE_DIR}/rank-(\d{{5}})\.pt$")
#: Top-level key of the Lightning checkpoint for the per-rank state: in a full file every rank's state,
#: in a sharded directory's ``meta.pt`` only which ranks wrote a :data:`RANK_STATE_DIR` file.
RANK_STATE_KEY = "lightning_sharded_rank_state"

#: Folder of a sharded directory with the per-rank index (:mod:`~lightning_sharded.checkpoint.rank_index`):
#: the layout that rank 0 writes, and one file per rank saying where the pieces it wrote are.
INDEX_DIR = "index"
#: The index layout: every key's dtype, shape and which rank wrote which piece.
INDEX_LAYOUT = f"{INDEX_DIR}/layout.json"
#: One rank's index file in :data:`INDEX_DIR`, with the rank that wrote it.
RANK_INDEX_FILE = re.compile(rf"^{INDEX_DIR}/rank-(\d{{5}})\.json$")

#: Top-level key of a trainable-only full checkpoint file: its frozen part (``FrozenPart.to_dict()``:
#: the model keys it does not hold and where they are read from). A sharded directory keeps it in its
#: manifest (``Manifest.frozen``).
FROZEN_KEY = "lightning_sharded_frozen"

#: A Hugging Face weights directory (``save_pretrained``, ``consolidate --format safetensors``): its one
#: weights file, or the index of its ``model-0000K-of-0000N.safetensors`` files, and their suffix.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"

STAGING = "staging"
OLD = "old"
TRASH = "trash"
SIBLING_KINDS = (STAGING, OLD, TRASH)


def optimizer_key(index: int) -> str:
    """The top-level key of the ``index``-th optimizer in a sharded directory."""
    return f"optimizer_{index}"


def rank_state_file(rank: int) -> str:
    """The path, relative to a sharded directory, of the per-rank state file of ``rank``."""
    return f"{RANK_STATE_DIR}/rank-{rank:05d}.pt"


def rank_index_file(rank: int) -> str:
    """The path, relative to a sharded directory, of the index file of ``rank``."""
    return f"{INDEX_DIR}/rank-{rank:05d}.json"


def shard_rank(name: str) -> int | None:
    """The rank that wrote shard file ``name``, or ``None`` for any other file."""
    m = SHARD_FILE.match(name)
    return int(m.group(1)) if m else None


def is_checkpoint_member(name: str) -> bool:
    """Whether a file of that name is one a sharded checkpoint (ours or stock, whole or not) holds."""
    return name in (MANIFEST_NAME, DCP_METADATA, LIGHTNING_METADATA) or (
        name.startswith("__") and name.endswith(".distcp")
    )


def _token() -> str:
    # Time first (fixed width hex), so tokens sort by creation time; random tail for uniqueness.
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}"


def sibling_name(name: str, kind: str) -> str:
    """A fresh hidden sibling name ``.<name>.<kind>-<token>`` for checkpoint ``name``."""
    return f".{name}.{kind}-{_token()}"


def data_dir_name() -> str:
    """A fresh version directory name ``data-<token>`` (object storage)."""
    return f"{DATA_PREFIX}{_token()}"


def sibling_pattern(name: str, kinds: tuple[str, ...] = SIBLING_KINDS) -> re.Pattern[str]:
    """Matches the siblings of checkpoint ``name`` of the given kinds; group 2 is the token."""
    return re.compile(rf"^\.{re.escape(name)}\.({'|'.join(kinds)})-([0-9a-f]{{24}})$")


def owner_name(sibling: str) -> str | None:
    """The checkpoint name a ``.<name>.<kind>-<token>`` sibling belongs to, or ``None``."""
    m = re.match(rf"^\.(.+)\.({'|'.join(SIBLING_KINDS)})-[0-9a-f]{{24}}$", sibling)
    return m.group(1) if m else None
