"""The unpickling allow-lists are the reviewed ones: adding or removing a global fails here, so a change
of what a checkpoint may run is a change of this file too, reviewed. Each entry carries its reason in
the code (``# ...`` on its line), and what the lists make active (torch's ``weights_only`` list during
a tools' load, the restricted unpickler of ``.metadata``, the inert reader of ``inspect``) is exactly
them. ``tests/checkpoint/test_hostile_payloads.py`` shows what an added ``getattr`` or ``eval`` does.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lightning_sharded.checkpoint.unpickling import allowed, inert, without_torch

ATTRIBUTE_DICT = {
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
}
LIGHTNING = ATTRIBUTE_DICT | {
    "argparse.Namespace",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
}
DCP_METADATA = {
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "collections.OrderedDict",
    "builtins.set",
    "builtins.frozenset",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
}
INERT = {
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch.nn.parameter.Parameter",
    "torch.Size",
    "torch.device",
    "torch.serialization._get_layout",
    "collections.OrderedDict",
    "collections.Counter",
    "builtins.set",
    "builtins.frozenset",
    "builtins.bytearray",
    "builtins.complex",
    "_codecs.encode",
}
#: What verify tells safe without torch: what torch.save writes for tensors and plain data.
TORCH_SAFE = {
    "collections.OrderedDict",
    "builtins.set",
    "_codecs.encode",
    "torch.Size",
    "torch.device",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch.serialization._get_layout",
    "torch.storage.UntypedStorage",
    *(
        f"torch.{t}Storage"
        for t in ("Half", "BFloat16", "Float", "Double", "Bool", "Byte", "Char", "Short", "Int", "Long")
    ),
    *(f"torch.{t}" for t in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")),
    *(f"torch.{t}" for t in ("bool", "uint8", "int8", "int16", "int32", "int64")),
}
#: What inspect builds without torch from a plain archive.
PLAIN = {"collections.OrderedDict", "builtins.set", "builtins.frozenset", "_codecs.encode"}
#: Never on any list: each calls or looks up something else (with getattr, an allowed path is a file
#: deleter: ``PosixPath(p).unlink()``).
NEVER = {
    "builtins.getattr",
    "builtins.eval",
    "builtins.exec",
    "builtins.compile",
    "builtins.__import__",
    "builtins.open",
    "functools.partial",
    "functools.reduce",
    "importlib.import_module",
    "operator.attrgetter",
    "operator.methodcaller",
    "os.system",
    "posix.system",
    "subprocess.Popen",
    "subprocess.run",
}


def _as_set(entries: tuple[str, ...]) -> set[str]:
    assert len(set(entries)) == len(entries), f"an entry twice: {sorted(entries)}"
    return set(entries)


def test_the_lists_are_the_reviewed_ones() -> None:
    assert _as_set(allowed.ATTRIBUTE_DICT_NAMES) == ATTRIBUTE_DICT
    assert _as_set(allowed.LIGHTNING_SAFE_GLOBALS) == LIGHTNING
    assert _as_set(allowed.DCP_METADATA_GLOBALS) == DCP_METADATA
    assert _as_set(inert.INERT_ALLOWED) == INERT
    assert without_torch.TORCH_SAFE == TORCH_SAFE
    assert _as_set(without_torch.PLAIN_GLOBALS) == PLAIN
    assert not (LIGHTNING | DCP_METADATA | INERT | TORCH_SAFE | PLAIN) & NEVER


def test_each_entry_says_why_in_the_code() -> None:
    for module, names in ((allowed, LIGHTNING | DCP_METADATA), (inert, INERT), (without_torch, PLAIN)):
        source = Path(str(module.__file__)).read_text()
        for name in sorted(names):
            reasons = re.findall(rf'^\s*"{re.escape(name)}",\s*#\s*(\S.*)$', source, re.MULTILINE)
            assert reasons, f"{name} has no reason on its line in {module.__name__}"


def _torch_list() -> set[str]:
    return {entry[1] for entry in torch.serialization.get_safe_globals() if isinstance(entry, tuple)}


def test_a_tools_load_adds_exactly_the_lightning_list_to_torch_s() -> None:
    before = _torch_list()
    with allowed.safe_globals():
        added = _torch_list() - before
    assert added == LIGHTNING  # every one is installed here (Lightning 2.x and its aliases)
    assert _torch_list() == before


def _without_torch_enums(names: set[str]) -> set[str]:
    enums = {
        str(v)
        for v in vars(torch).values()
        if isinstance(v, torch.dtype | torch.layout | torch.memory_format)
    }
    return names - enums


def test_the_metadata_reader_builds_exactly_its_list() -> None:
    """Besides torch's dtypes, layouts and memory formats, and what is on torch's own ``weights_only``
    list (``torch.serialization.get_safe_globals()``: torch's and the user's additions)."""
    torch_s = set()
    for entry in torch.serialization.get_safe_globals():
        _, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        torch_s.add(name)
    built = _without_torch_enums(set(allowed.allowed_objects(allowed.DCP_METADATA_GLOBALS)))
    assert built - torch_s == DCP_METADATA - torch_s
    assert not torch_s & NEVER
