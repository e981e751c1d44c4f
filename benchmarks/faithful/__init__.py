"""The faithful limit: what a save and a load of the benchmark's checkpoint must do at best, on the
checkpoint's own files, with nothing of DCP, Lightning or the strategies around it.

- **Write** (:func:`write_like`, collective): every rank writes the files it wrote in the save just
  timed, at the sizes the save gave them (:func:`layout_of` reads them from the checkpoint: the shard
  ``__<r>_*.distcp`` and the per-rank state file are rank ``r``'s, every other file rank 0's), from its
  own state's bytes (what the save wrote, so the disk sees the same data), in a staging directory next
  to the target; each file is ``fsync``-ed, rank 0 then writes ``.metadata`` (through a temporary name
  and a rename, as DCP does), ``meta.pt`` and the manifest last (temporary name, rename), ``fsync``-s
  every directory and publishes with a rename, then ``fsync``-s the parent, as the commit does. With
  ``behind`` the large files are written as a save's writer writes them
  (:class:`~lightning_sharded.checkpoint.writeback.WriteBehind`: write-back started as each piece is
  written, the pages on disk dropped behind); without, plainly (the kernel starts the write-back at
  the ``fsync``).
- **Read** (:func:`read_like`): every rank reads, cold (the real checkpoint's files evicted), exactly
  the bytes its resume read: the DCP items of the resume's plan, recorded from the real resume
  (:func:`recording_reads`), each once, plus the small files a resume needs (rank 0: ``.metadata``,
  ``meta.pt``, the manifest; each rank: its own per-rank state file). Two streams per rank, each its
  contiguous half in file order, pieces of 4 MiB into a reused buffer, the page cache dropped behind
  every large item: the way our reader reads
  (:class:`~lightning_sharded.checkpoint.backends.dcp_reader.DirectReader`), which is the best this
  disk was measured to allow (one stream per rank got half the bandwidth).
- **Read into the resume's memory** (:func:`read_into_resume_memory`): the same bytes into memory laid
  out as the resume's (the model's items into memory touched before, the optimizer's into new tensors),
  through the reader's own reads.
- **Copy** (:func:`copy_like`, one process): ``consolidate``'s bar, the source read cold and written
  into one file of the output's size, written behind, ``fsync``, rename.

The write half is :mod:`~benchmarks.faithful.writes`, the read half :mod:`~benchmarks.faithful.reads`.
``probe_writes`` and ``probe_reads`` are the rank cases' calls: after each timed save and after each
timed resume, interleaved with them so both see the same disk.
"""

from benchmarks.faithful.reads import (
    Extent,
    probe_reads,
    read_into_resume_memory,
    read_like,
    recording_reads,
    resume_extents,
)
from benchmarks.faithful.writes import (
    File,
    Layout,
    copy_like,
    kind,
    layout_of,
    owner,
    probe_writes,
    state_buffers,
    write_like,
)

__all__ = [
    "Extent",
    "File",
    "Layout",
    "copy_like",
    "kind",
    "layout_of",
    "owner",
    "probe_reads",
    "probe_writes",
    "read_into_resume_memory",
    "read_like",
    "recording_reads",
    "resume_extents",
    "state_buffers",
    "write_like",
]
