"""What verify reads without importing torch gives torch's answers, or none (then torch answers).

:mod:`lightning_sharded.checkpoint.unpickling.without_torch` tells a ``torch.save`` archive of tensors
and plain data safe, and reads DCP's ``.metadata`` with stand-ins for torch's classes. Each case here
is compared with torch's own reading of the same bytes; the command line's run without torch is in
``test_unpickling.py`` (``test_verify_of_every_strategy_s_checkpoint_needs_no_torch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict
from torch import nn
from torch._weights_only_unpickler import _get_allowed_globals
from torch.utils.serialization import config as torch_save

from lightning_sharded.checkpoint import names, unpickling
from lightning_sharded.checkpoint.backends import LocalBackend
from lightning_sharded.checkpoint.dcp_index import index_problems, read_index, top_level_keys
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.unpickling import without_torch
from tests.checkpoint.one_process import save_sharded, stepped
from tests.hostile import HOSTILE_NAME, Marker

# payload, and whether it is told safe without torch (False: torch answers)
CASES: dict[str, tuple[Callable[[Path], Any], bool]] = {
    "tensors": (lambda _: {"w": torch.randn(2, 3), "h": torch.ones(2, dtype=torch.bfloat16)}, True),
    "ints and bools": (lambda _: [torch.arange(4), torch.zeros(2, dtype=torch.bool)], True),
    "a parameter": (lambda _: nn.Parameter(torch.ones(2)), True),
    "plain data": (lambda _: OrderedDict(a=1, b=[1.5, "x", b"y", None, True], c={1, 2}, d=(1,)), True),
    "sizes, devices, dtypes": (lambda _: [torch.Size([2, 3]), torch.device("cpu"), torch.float64], True),
    "Lightning's types": (
        lambda _: {"hp": AttributeDict(a=1), "ns": argparse.Namespace(x=1), "p": Path("/x")},
        True,
    ),
    "a complex number": (lambda _: complex(1, 2), False),  # torch allows it; not on our list
    "a numpy array": (lambda _: np.arange(3), False),
    "hostile": (lambda tmp: {"x": Marker(tmp / "marker")}, False),
}


def _saved(obj: Any, *, crc: bool = True) -> bytes:
    """``torch.save`` of ``obj``, with or without the records' CRC-32 (torch.save's setting)."""
    buffer, before = io.BytesIO(), torch_save.save.compute_crc32
    torch_save.save.compute_crc32 = crc
    try:
        torch.save(obj, buffer)
    finally:
        torch_save.save.compute_crc32 = before
    return buffer.getvalue()


def torch_answer(data: bytes, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """:func:`unpickling.unsafe_globals` as it was before, torch reading every archive."""
    with monkeypatch.context() as m:
        m.setattr(without_torch, "archive_is_safe", lambda source: False)
        return unpickling.unsafe_globals(data)


def test_every_name_told_safe_is_safe_for_the_installed_torch() -> None:
    assert not without_torch.TORCH_SAFE - set(_get_allowed_globals())


@pytest.mark.parametrize("crc", [True, False], ids=["crc", "no-crc"])
@pytest.mark.parametrize("case", CASES)
def test_an_archive_told_safe_is_one_torch_finds_safe(
    case: str, crc: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, told = CASES[case]
    data = _saved(make(tmp_path), crc=crc)
    assert without_torch.archive_is_safe(data) is told
    found = torch_answer(data, monkeypatch)
    if case == "hostile":
        assert found == [HOSTILE_NAME]
    elif case == "a numpy array":
        assert found and all(name.startswith("numpy") for name in found)
    else:
        assert found == []
    assert unpickling.unsafe_globals(data) == found  # with the shortcut: the same answer
    assert unpickling.unsafe_globals(io.BytesIO(data)) == found


def test_a_damaged_archive_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _saved({"w": torch.ones(3)})
    for damaged in (data[: len(data) // 2], b"not a zip file", data[:-30]):
        assert without_torch.archive_is_safe(damaged) is False
        with pytest.raises(Exception) as torch_error:
            torch_answer(damaged, monkeypatch)
        with pytest.raises(type(torch_error.value)):
            unpickling.unsafe_globals(damaged)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_a_torchscript_archive_is_left_to_torch(tmp_path: Path) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(path))
    assert without_torch.archive_is_safe(path.read_bytes()) is False


def test_an_archive_marked_as_torchscript_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain data beside a ``constants.pkl`` record, which torch takes for a TorchScript archive."""
    buffer = io.BytesIO(_saved({"w": torch.ones(3)}))
    with zipfile.ZipFile(buffer, "a") as archive:
        prefix = archive.namelist()[0].split("/")[0]
        archive.writestr(f"{prefix}/constants.pkl", pickle.dumps(()))
    data = buffer.getvalue()
    assert without_torch.archive_is_safe(data) is False
    with pytest.raises(ValueError, match="torchscript"):
        torch_answer(data, monkeypatch)


def test_the_stand_ins_have_the_none_defaults_of_dcp_s_classes() -> None:
    """On every torch the suite runs with (2.13 and 2.15 in CI)."""
    standins = without_torch._STANDINS
    for name in unpickling.DCP_METADATA_GLOBALS:
        cls = unpickling.allowed.resolve_name(name)
        if not dataclasses.is_dataclass(cls):
            continue
        none = {f.name for f in dataclasses.fields(cls) if f.default is None}
        stand_in = {
            k for k in dir(standins[name]) if not k.startswith("_") and getattr(standins[name], k) is None
        }
        assert none <= stand_in, name  # (a stand-in may also have a field of another torch: strides)


@pytest.mark.parametrize("case", CASES)
def test_a_plain_archive_reads_as_torch_reads_it(case: str, tmp_path: Path) -> None:
    make, _ = CASES[case]
    data = _saved(make(tmp_path))
    value = without_torch.read_plain(data)
    plain = case == "plain data"  # no tensor, no class: read without torch
    assert (value is not without_torch.NOT_READ) is plain
    if plain:
        assert value == torch.load(io.BytesIO(data), weights_only=True)
        assert type(value) is type(torch.load(io.BytesIO(data), weights_only=True))
    assert not (tmp_path / "marker").exists()  # the hostile case ran nothing
    assert without_torch.read_plain(data[: len(data) // 2]) is without_torch.NOT_READ


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model.register_buffer("count", torch.arange(3))  # an int64 tensor beside the float32 ones
    model.register_buffer("low", torch.ones(2, dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    stepped(model, optimizer, 4)
    return save_sharded(tmp_path / "ckpt", model, optimizer)


def _outline(metadata: Any) -> dict[str, Any]:
    """Everything verify reads of a DCP index, in plain values."""
    entries = {}
    for key, value in metadata.state_dict_metadata.items():
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in getattr(value, "chunks", [])]
        dtype = getattr(getattr(value, "properties", None), "dtype", None)
        kind = (str(dtype), dtype.itemsize) if dtype is not None else None
        entries[key] = (without_torch.type_name(value), tuple(getattr(value, "size", ())), chunks, kind)
    return {
        "type": without_torch.type_name(metadata),
        "tops": top_level_keys(metadata),
        "entries": entries,
        "planner": metadata.planner_data,
        "storage": {
            (i.fqn, None if i.offset is None else tuple(i.offset), i.index): (
                str(s.relative_path),
                int(s.offset),
                int(s.length),
                getattr(s, "transform_descriptors", None),
            )
            for i, s in metadata.storage_data.items()
        },
    }


def test_the_stand_ins_read_what_dcp_reads(sharded: Path) -> None:
    backend = LocalBackend()
    real = read_index(backend, sharded, weights_only=True)
    standins = read_index(backend, sharded, weights_only=True, standins=True)
    assert type(standins) is not type(real)  # the stand-ins were read, not torch's classes
    assert _outline(standins) == _outline(real)
    assert {"state_dict", "optimizer_0"} <= _outline(real)["tops"]
    assert index_problems(backend, sharded, standins) == index_problems(backend, sharded, real) == []
    (sharded / "__0_0.distcp").write_bytes(b"")
    problems = index_problems(backend, sharded, standins)
    assert problems and problems == index_problems(backend, sharded, real)


def test_a_metadata_with_another_global_is_left_to_torch(sharded: Path) -> None:
    backend = LocalBackend()
    file = sharded / names.DCP_METADATA
    metadata = read_index(backend, sharded, weights_only=True)
    metadata.planner_data["odd"] = Fraction(1, 3)
    file.write_bytes(pickle.dumps(metadata))
    assert without_torch.read_dcp_metadata(io.BytesIO(file.read_bytes())) is None
    with pytest.raises(unpickling.RefusedPickleError, match=r"fractions\.Fraction"):
        read_index(backend, sharded, weights_only=True, standins=True)
    file.write_bytes(file.read_bytes()[:100])  # cut short: torch's error, as without stand-ins
    with pytest.raises(CheckpointError) as without:
        read_index(backend, sharded, weights_only=True)
    with pytest.raises(CheckpointError) as with_standins:
        read_index(backend, sharded, weights_only=True, standins=True)
    assert str(with_standins.value) == str(without.value)


def _tensor_archive(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("tensor", "record"),
    [
        (torch.arange(6.0).view(2, 3), ("float32", (2, 3), False)),
        (torch.ones(1, 4, dtype=torch.bfloat16), ("bfloat16", (1, 4), False)),
        (torch.ones(4, 1).t(), ("float32", (1, 4), False)),  # contiguous: a size-1 dim's stride is free
        (torch.tensor(7), ("int64", (), False)),
        (torch.zeros(0, 3, dtype=torch.bool), ("bool", (0, 3), False)),
        (torch.ones(2, requires_grad=True), ("float32", (2,), True)),
        (torch.arange(6.0).view(2, 3).t(), None),  # transposed: not contiguous
        (torch.arange(6.0)[2:], None),  # a view: part of its storage
        (torch.arange(6.0)[::2], None),  # strided
        (nn.Parameter(torch.ones(2)), None),  # _rebuild_parameter
        (torch.ones(2, dtype=torch.complex64).conj(), None),  # a conjugate bit: metadata
        (torch.ones(2, dtype=torch.float8_e4m3fn), None),  # a dtype outside the common ones
    ],
    ids=[
        "2d",
        "bf16-row",
        "row-of-a-column",
        "scalar",
        "empty",
        "grad",
        "transposed",
        "view",
        "strided",
        "param",
        "conj",
        "fp8",
    ],
)
def test_a_chunk_s_pickle_is_read_only_where_it_is_its_storage(tensor: torch.Tensor, record: Any) -> None:
    # What consolidate reads of each DCP tensor entry without torch: its dtype, shape and storage key,
    # only for a tensor whose bytes are its whole storage, contiguous (anything else is left to torch).
    with zipfile.ZipFile(io.BytesIO(_tensor_archive(tensor))) as archive:
        (pkl,) = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        found = without_torch.tensor_record(archive.read(pkl))
    if record is None:
        assert found is None
        return
    assert found is not None and (found.dtype, found.shape, found.requires_grad) == record
    assert found.nbytes == tensor.numel() * tensor.element_size()
    assert found.key == "0"
