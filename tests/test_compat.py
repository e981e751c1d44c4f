"""The one seam to torch's and Lightning's private names (``lightning_sharded/_compat.py``).

- no module of the package but ``_compat`` imports a private torch or Lightning name (or module), nor
  names one for ``importlib.import_module``: an AST scan, checked against an injected violation;
- every name ``_compat`` reaches exists in the installed torch and Lightning (a release that removes one
  fails here, not in a user's run);
- the frames the state-dict hooks read (``nn.Module.load_state_dict``'s ``strict``, ``assign``,
  ``state_dict`` and its nested ``load``'s ``module``, ``prefix``) are where they are read, and a torch
  that changes them makes every load fail loudly instead of guessing.
"""

from __future__ import annotations

import ast
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_sharded import _compat

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_sharded"
SEAM = PACKAGE / "_compat.py"
ROOTS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")


def _private_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] in ROOTS and any(p.startswith("_") and not p.startswith("__") for p in parts)


#: Where a private torch name may be spelled as a string: the names of the globals torch's own pickles
#: reference (``torch._utils._rebuild_tensor_v2``...), the allow-lists of the safe unpickler. They describe
#: the file format (what a checkpoint holds), not code of the package; nothing imports them there.
PICKLE_GLOBALS = PACKAGE / "checkpoint" / "unpickling"


def _dotted_private(value: object) -> bool:
    if not isinstance(value, str):
        return False
    parts = value.split(".")
    return len(parts) > 1 and all(p.isidentifier() for p in parts) and _private_module(value)


def private_uses(source: str, strings: bool = True) -> list[str]:
    """Every private torch/Lightning import in ``source``, ``import_module`` of a private module, and (with
    ``strings``) a private module or name spelled as a dotted string (a ``sys.modules`` lookup)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if strings and isinstance(node, ast.Constant) and _dotted_private(node.value):
            found.append(f"the string {node.value!r}")
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _private_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ROOTS:
                continue
            found += [
                f"from {node.module} import {a.name}"
                for a in node.names
                if _private_module(node.module) or (a.name.startswith("_") and not a.name.startswith("__"))
            ]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found += [f"import_module({a!r})" for a in args if _private_module(a) and not strings]
    return found


def test_only_the_seam_imports_private_torch_and_lightning_names() -> None:
    outside = {
        str(path.relative_to(REPO)): private_uses(
            path.read_text(), strings=not path.is_relative_to(PICKLE_GLOBALS)
        )
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != SEAM
    }
    assert {k: v for k, v in outside.items() if v} == {}, "import these through lightning_sharded._compat"
    assert len(private_uses(SEAM.read_text())) >= 10  # the scan sees them where they are


@pytest.mark.parametrize(
    "line",
    [
        "from torch.distributed.checkpoint.utils import _create_file_view\n",
        "from torch.distributed._shard.sharded_tensor import ShardedTensor\n",
        "import torch._dynamo\n",
        "def f():\n    from lightning.fabric.utilities.types import _PATH\n",
        "import importlib\nimportlib.import_module('torch.distributed.fsdp._state_dict_utils')\n",
        "import sys\nsys.modules.get('torch.distributed._shard.sharded_tensor.api')\n",
    ],
)
def test_the_scan_catches_a_private_import(line: str) -> None:
    assert private_uses(textwrap.dedent(line))
    assert private_uses("from torch.distributed.checkpoint import FileSystemReader\nimport torch.nn\n") == []


def test_every_name_the_seam_reaches_exists_here() -> None:
    _compat.fsspec_filesystem().FsspecReader  # noqa: B018
    _compat.fsspec_filesystem().FsspecWriter  # noqa: B018
    _compat.fsspec_filesystem().FileSystem  # noqa: B018
    assert len(_compat.sharded_tensor_api()) == 5
    assert _compat.fsdp1_names() == ("_fsdp_wrapped_module.", "_flat_param")
    assert callable(_compat.fsdp1_state_dict_utils()._common_pre_state_dict_hook)
    assert _compat.strided_shard() is not None
    assert _compat.storage_info("a", 0, 1).relative_path == "a"
    flat, _ = _compat.flatten_state_dict(_compat.flatten_sharded_tensors({"a": {"b": torch.ones(1)}}))
    assert list(flat) == ["a.b"]
    assert [tuple(c.sizes) for c in _compat.create_chunk_list(torch.ones(2, 3))] == [(2, 3)]
    for name in ("_create_file_view", "_load_state_dict", "_get_object_coll_device", "_get_default_store"):
        source = SEAM.read_text()
        assert name in source
    from torch.distributed import distributed_c10d
    from torch.distributed.checkpoint import state_dict_loader, utils

    assert callable(utils._create_file_view) and callable(state_dict_loader._load_state_dict)
    assert callable(distributed_c10d._get_object_coll_device) and callable(
        distributed_c10d._get_default_store
    )
    import importlib

    for module in (
        _compat.SHARDED_TENSOR_MODULE,
        _compat.CHECKPOINT_WRAPPER_MODULE,
        _compat.DYNAMO_EVAL_FRAME_MODULE,
    ):
        importlib.import_module(module)


def test_the_hooks_read_the_callers_strict_assign_and_state_dict() -> None:
    """What the hooks rely on, on every supported torch: a pre-hook sees the caller's arguments through
    :func:`_compat.load_call`, a post-hook its module's prefix through :func:`_compat.running_load`."""
    seen: list[object] = []
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(inner)

    def pre(module: nn.Module, *args: object) -> None:
        seen.append(_compat.load_call(sys._getframe(1)))

    def post(module: nn.Module, incompatible: object) -> None:
        seen.append(_compat.running_load(module, sys._getframe(1)))

    inner.register_load_state_dict_pre_hook(pre)
    inner.register_load_state_dict_post_hook(post)
    state = outer.state_dict()
    outer.load_state_dict(state, strict=False, assign=True)
    (strict, assign, whole), running = seen
    assert (strict, assign) == (False, True) and list(whole) == list(state)  # its copy of the dict
    assert running is not None and running[:3] == ("0.", False, True) and running[3] is whole
    assert _compat.load_call(sys._getframe()) == (True, False, None)  # no load running


def test_a_torch_whose_load_state_dict_changed_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """If a torch release renames ``strict`` (or drops the nested ``load``), every load through the hooks
    raises, naming torch's version and what is missing, instead of loading with a guessed ``strict``."""

    def load_state_dict(self: nn.Module, state_dict: object, strict_mode: bool = True) -> None:
        def load(module: nn.Module, local_state_dict: object, prefix: str = "") -> None:
            pass

        load(self, state_dict)

    monkeypatch.setattr(_compat, "_load_frames", None)
    monkeypatch.setattr(nn.Module, "load_state_dict", load_state_dict)
    with pytest.raises(RuntimeError, match=r"load_state_dict has no strict, assign.*torch 2\.13 to 2\.15"):
        _compat.load_frames()
    monkeypatch.undo()
    assert isinstance(_compat.load_frames()[0], types.CodeType)
