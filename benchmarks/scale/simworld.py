"""A simulated world of N ranks around the one this process plays (``benchmarks.scale``).

:class:`SimWorld` stands in for the other ranks of a fake process group (``backend="fake"``, whose
collectives return at once): the object collectives are served in process. Rank 0 runs first and
records what it broadcasts or scatters (a tape); another rank then replays the tape, as it would
receive it. What rank 0 gathers from rank ``k`` is this rank's own contribution rewritten as rank
``k``'s: DCP save plans and write results with the shard offsets and file names of rank ``k`` (the
model is sharded evenly along dim 0), our commit reports with rank ``k``'s shard entries; the shard
files of rank ``k`` are copies of rank 0's (made while nothing is counted, by the store's
``replicate``).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from typing import Any


def _nbytes(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:
        return 0


class SimWorld:
    """The other ranks of a fake process group of ``world_size``, for one rank's run (see the module doc).

    Args:
        rank: The rank this process plays.
        world_size: N.
        tape: What rank 0 broadcast and scattered, in order (recorded when ``rank == 0``, replayed else).
        replicate: Called on rank 0 with ``(own relative path, rank k's relative path)`` when rank ``k``'s
            write results are made up from rank 0's, to put rank ``k``'s file in place.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        tape: list[bytes],
        replicate: Callable[[str, str], tuple[int, str]] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.tape = tape
        self.cursor = 0
        self.replicate = replicate
        self._shard_rows: dict[Any, int] = {}  # MetadataIndex of this rank's shard items -> rows
        self._shard_files: list[tuple[str, int, str]] = []  # (relative path, size, crc32) of own shards
        self._last_gathered: Any = None
        self.cpu = 0.0  # seconds spent in the simulation itself (not the rank's own work)
        self.wall = 0.0
        #: Seconds of the collectives' pickling that are the rank's own work in a real world (its
        #: ``pickle.dumps`` of what it sends, ``pickle.loads`` of what it receives), measured inside the
        #: simulated collectives: :func:`~benchmarks.scale.counting.instrument` keeps them in the rank's time.
        self.own_cpu = 0.0

    # -- what the other ranks would send ----------------------------------------------------------

    def _as_rank(self, obj: Any, k: int) -> Any:
        if k == self.rank:
            return obj
        from torch.distributed.checkpoint.planner import LoadPlan, SavePlan

        if isinstance(obj, SavePlan):
            return self._save_plan_as(obj, k)
        if isinstance(obj, LoadPlan):
            return obj
        if isinstance(obj, list) and obj and type(obj[0]).__name__ == "WriteResult":
            return self._write_results_as(obj, k)
        if (
            isinstance(obj, tuple)
            and len(obj) == 2
            and isinstance(obj[0], list)
            and (not obj[0] or type(obj[0][0]).__name__ == "FileEntry")
            and (obj[1] is None or isinstance(obj[1], str))
            and self._shard_files
        ):
            return self._report_as(obj, k)
        return obj

    def _shift(self, offsets: Any, rows: int, k: int) -> Any:
        import torch

        return torch.Size([offsets[0] + (k - self.rank) * rows, *offsets[1:]])

    def _save_plan_as(self, plan: Any, k: int) -> Any:
        from torch.distributed.checkpoint.planner import WriteItemType

        items = []
        for item in plan.items:
            if item.type != WriteItemType.SHARD:
                continue  # DCP's non-coordinator plans hold sharded items only
            chunk = item.tensor_data.chunk
            rows = int(chunk.sizes[0])
            self._shard_rows[item.index] = rows
            offsets = self._shift(chunk.offsets, rows, k)
            items.append(
                dataclasses.replace(
                    item,
                    index=dataclasses.replace(item.index, offset=offsets, index=None),
                    tensor_data=dataclasses.replace(
                        item.tensor_data, chunk=dataclasses.replace(chunk, offsets=offsets)
                    ),
                )
            )
        return dataclasses.replace(plan, items=items)

    def _write_results_as(self, results: list[Any], k: int) -> list[Any]:
        own, theirs = f"__{self.rank}_", f"__{k}_"
        out = []
        files: dict[str, str] = {}
        for result in results:
            rows = self._by_index(result.index)
            if rows is None:
                continue
            relative = str(result.storage_data.relative_path)
            files[relative] = relative.replace(own, theirs, 1)
            out.append(
                dataclasses.replace(
                    result,
                    index=dataclasses.replace(
                        result.index, offset=self._shift(result.index.offset, rows, k), index=None
                    ),
                    storage_data=dataclasses.replace(result.storage_data, relative_path=files[relative]),
                )
            )
        if self.replicate is not None:
            for mine, other in sorted(files.items()):
                size, crc = self.replicate(mine, other)
                self._remember(mine, size, crc)
        return out

    def _by_index(self, index: Any) -> int | None:
        for known, rows in self._shard_rows.items():
            if known.fqn == index.fqn and tuple(known.offset) == tuple(index.offset):
                return rows
        return None

    def _remember(self, relative: str, size: int, crc: str) -> None:
        if relative not in {f for f, _, _ in self._shard_files}:
            self._shard_files.append((relative, size, crc))

    def _report_as(self, report: tuple[list[Any], str | None], k: int) -> tuple[list[Any], str | None]:
        from lightning_sharded.checkpoint.manifest import FileEntry

        own, theirs = f"__{self.rank}_", f"__{k}_"
        entries = [
            FileEntry(path.replace(own, theirs, 1), size, crc, k) for path, size, crc in self._shard_files
        ]
        index = self._rank_index_as(k)
        if index is not None:
            entries.append(index)
        return entries, None

    def _rank_index_as(self, k: int) -> Any:
        """Rank ``k``'s per-rank index file, made from this rank's (its shard pieces moved to rank
        ``k``'s rows and file) and put in place; its manifest entry. ``None`` without such a file."""
        import json

        from lightning_sharded.checkpoint import names
        from lightning_sharded.checkpoint.manifest import FileEntry

        put = getattr(self.replicate, "put", None)
        read = getattr(self.replicate, "read", None)
        if put is None or read is None:
            return None
        mine = read(names.rank_index_file(self.rank))
        if mine is None:
            return None
        raw = json.loads(mine)
        own, theirs = f"__{self.rank}_", f"__{k}_"
        items = []
        for fqn, offsets, sizes, relative, offset, length in raw["items"]:
            rows = self._shard_rows_of(fqn, offsets)
            if rows is None:
                continue  # not a shard: rank 0 alone wrote it
            moved = list(self._shift(offsets, rows, k))
            items.append([fqn, moved, sizes, relative.replace(own, theirs, 1), offset, length])
        data = json.dumps({**raw, "rank": k, "items": sorted(items)}, separators=(",", ":"), sort_keys=True)
        rel = names.rank_index_file(k)
        size, crc = put(rel, data.encode())
        return FileEntry(rel, size, crc, k)

    def _shard_rows_of(self, fqn: str, offsets: list[int]) -> int | None:
        for known, rows in self._shard_rows.items():
            if known.fqn == fqn and list(known.offset) == list(offsets):
                return rows
        return None

    # -- the object collectives --------------------------------------------------------------------

    def _own(self, sent: Any = None, received: Any = None, times: int = 1) -> None:
        """Time the rank's own pickling: ``sent`` pickled once, ``received`` unpickled ``times`` times
        (what the other ranks send is as large as what this rank sends: one unpickle of it, times N - 1)."""
        import time

        start = time.process_time()
        if sent is not None:
            data = pickle.dumps(sent)
            if received is True:  # unpickle what is like what this rank sent
                once = time.process_time()
                pickle.loads(data)
                self.own_cpu += (time.process_time() - once) * (times - 1)
        elif received is not None:
            pickle.loads(received if isinstance(received, bytes) else pickle.dumps(received))
        self.own_cpu += time.process_time() - start

    def _record_or_replay(self, value: Any, src_is_me: bool) -> Any:
        if src_is_me:
            self.tape.append(pickle.dumps(value))
            return value
        if self.cursor >= len(self.tape):
            raise RuntimeError("the simulated world ran out of rank 0's broadcasts (the ranks diverged)")
        value = pickle.loads(self.tape[self.cursor])
        self.cursor += 1
        return value

    def broadcast_object_list(self, object_list: list[Any], src: int = 0, **_: Any) -> int:
        if self.rank != src and self.cursor < len(self.tape):
            self._own(received=self.tape[self.cursor])
        value = self._record_or_replay(list(object_list), self.rank == src)
        if self.rank == src:
            self._own(sent=value)
        object_list[:] = value
        return _nbytes(value)

    def all_gather_object(self, object_list: list[Any], obj: Any, **_: Any) -> int:
        self._last_gathered = obj
        self._own(sent=obj, received=True, times=self.world_size)
        for k in range(self.world_size):
            object_list[k] = self._as_rank(obj, k)
        return _nbytes(obj) * self.world_size

    def gather_object(
        self, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, **_: Any
    ) -> int:
        self._last_gathered = obj
        if self.rank != dst or object_gather_list is None:
            self._own(sent=obj)
            return _nbytes(obj)
        self._own(sent=obj, received=True, times=self.world_size)
        for k in range(self.world_size):
            object_gather_list[k] = self._as_rank(obj, k)
        flush = getattr(self.replicate, "flush", None)
        if flush is not None:  # files of the other ranks put in place in one batch
            flush()
        return _nbytes(obj) * self.world_size

    def scatter_object_list(
        self,
        scatter_object_output_list: list[Any],
        scatter_object_input_list: list[Any] | None = None,
        src: int = 0,
        **_: Any,
    ) -> int:
        from torch.distributed.checkpoint.planner import LoadPlan

        if self.rank == src:
            assert scatter_object_input_list is not None
            # each rank's object on the tape apart, after their count: a replaying rank unpickles its
            # own only (the whole list would count N ranks' objects in its time and peak memory)
            self.tape.append(pickle.dumps(len(scatter_object_input_list)))
            self.tape.extend(pickle.dumps(obj) for obj in scatter_object_input_list)
            self._own(sent=list(scatter_object_input_list))
            scatter_object_output_list[0] = scatter_object_input_list[src]
        else:
            if self.cursor >= len(self.tape):
                raise RuntimeError("the simulated world ran out of rank 0's broadcasts (the ranks diverged)")
            count = pickle.loads(self.tape[self.cursor])
            mine = pickle.loads(self.tape[self.cursor + 1 + self.rank])
            self.cursor += 1 + count
            if isinstance(self._last_gathered, LoadPlan):
                mine = self._last_gathered  # DCP's global load plan is each rank's own (it changes nothing)
            scatter_object_output_list[0] = mine
            self._own(received=mine)  # its own piece only, not the whole list replayed
        return _nbytes(scatter_object_output_list[0])
