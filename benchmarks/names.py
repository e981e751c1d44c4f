"""The one table of display names: what each case is called in the tables and on the chart.

The tables (and the row keys of ``results.json``) use :attr:`Name.label`; the chart uses
:attr:`Name.short`. Rows that add something to a strategy's name (its async save, its training step)
are built by :func:`async_label` and :func:`training_label` and shortened by :func:`shorten`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Name:
    """A case's name in the tables (``label``) and on the chart (``short``)."""

    label: str
    short: str


NAMES: dict[str, Name] = {
    "torch": Name("torch.save / torch.load (per rank)", "torch.save/load"),
    "dcp": Name("dcp.save / dcp.load", "dcp.save/load"),
    "dcp-async": Name("dcp.async_save (stock torch)", "torch dcp.async_save"),
    "stock-mp": Name("stock ModelParallelStrategy", "stock ModelParallel"),
    "stock-fsdp": Name("stock FSDPStrategy", "stock FSDP"),
    "ours-mp": Name("ShardedModelParallelStrategy", "ShardedModelParallel"),
    "ours-fsdp": Name("ShardedFSDPStrategy", "ShardedFSDP"),
}
#: Which stock strategy each of ours is compared with ("resume vs stock", "save vs stock").
STOCK = {"ours-mp": "stock-mp", "ours-fsdp": "stock-fsdp"}

_ASYNC = " async_save=True"
_ROWS = " rows per step"


def label(case: str) -> str:
    """``case``'s name in the tables (``"ours-mp"``: ``"ShardedModelParallelStrategy"``)."""
    return NAMES[case].label


def short(case: str) -> str:
    """``case``'s name on the chart."""
    return NAMES[case].short


def async_label(strategy: str) -> str:
    """The async-save table's row of ``strategy`` (ours: saved with ``async_save=True``)."""
    return label(strategy) + _ASYNC


def training_label(strategy: str, batch: object, kind: str) -> str:
    """The training-while-saving table's row: ``strategy``, ``batch`` rows per step, what bounds it."""
    return f"{label(strategy)}, {batch}{_ROWS} ({kind})"


def shorten(row: str) -> str:
    """A row's label as the chart shows it: every long name short, the row's additions abridged."""
    for name in NAMES.values():
        row = row.replace(name.label, name.short)
    return row.replace(_ASYNC, "").replace(_ROWS, " rows")
