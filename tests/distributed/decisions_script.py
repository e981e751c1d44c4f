"""Rank script: checks that pick a code path are shared, so one rank that sees something else never
leaves the others waiting in a collective.

Cases (one checkpoint of a plain module, saved by both ranks), each a load on both ranks:

- ``meta``: rank 0 alone fails to read ``meta.pt`` (it is read once, on rank 0, and shared);
- ``meta-other``: rank 1 alone would fail to read it: nobody does (rank 1 never reads it);
- ``shard``: rank 1 alone sees ``__1_0.distcp`` missing (a stale listing);
- ``verify``: the checksum pass before a read (``check_found(verify=True)``) with one file corrupted:
  each file is checksummed by one rank only;
- ``during``, ``during-damaged``, ``before-damaged``: ``verify="during"`` (and ``True`` on the damaged
  one) on a DTensor checkpoint (each rank's 2 MiB shard
  read directly), whole, then with a byte of rank 1's shard flipped;
- ``full``: rank 1 alone cannot read a full checkpoint file;
- ``rank-state``: a full file's per-rank state where rank 1's entry is not its own (rank 0's is);
- ``verify-missing``: the checksum pass with a file of rank 0's missing that rank 1 checksums.

Each rank writes ``OUT/rank{R}.json``: per case the error type and message (or None), the seconds it
took, the manifest entries it was sent (a load that succeeded), for ``verify`` the files this rank
checksummed, for ``during`` the bytes of each file this rank read with checksums and whether the
values came back, for ``during-damaged`` the files it completed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_sharded.checkpoint import collective, load, names, rank_state, save
from lightning_sharded.checkpoint.backends import local
from lightning_sharded.checkpoint.detect import detect
from lightning_sharded.checkpoint.integrity import check_found
from lightning_sharded.checkpoint.load import sharded


def full_gathers() -> dict[str, list[Any]]:
    """``"full"`` state dicts of FSDP1 and FSDP2 models: ``[model keys, optimizer states, a checksum]``
    on this rank (rank 0 only should hold anything)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from lightning_sharded.checkpoint import state_dicts

    found: dict[str, list[Any]] = {}
    for kind in ("fsdp1", "fsdp2"):
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        if kind == "fsdp1":
            model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        else:
            mesh = init_device_mesh("cpu", (2,))
            fully_shard(model[0], mesh=mesh)  # type: ignore[index]
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 16)).sum().backward()
        optimizer.step()
        sd = state_dicts.model_state_dict(model, full=True)
        osd = state_dicts.optimizer_state_dict(model, optimizer, full=True)
        total = float(sum(v.sum() for v in sd.values())) if sd else None
        found[kind] = [sorted(sd), len(osd.get("state", {})), total]
    return found


def during_cases(out: Path, rank: int, results: dict[str, Any]) -> None:
    """``verify="during"``: checksums from the reads, each file completed by the rank that read it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lightning_sharded.checkpoint import integrity

    mesh = init_device_mesh("cpu", (2,))

    def module(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Module()
        m.weight = nn.Parameter(distribute_tensor(torch.randn(1024, 1024), mesh, [Shard(0)]))  # 2 MiB a rank
        return m

    saved = module(0)
    ckpt = out / "during"
    save.write_sharded_checkpoint(ckpt, {"model": saved.state_dict()}, {"global_step": 4}, rank=rank)
    covered: dict[str, int] = {}
    completed: list[str] = []
    real_check, real_ranges = integrity.ReadVerification.check, local.ranges_checksum

    def recording_check(self: Any) -> None:
        covered.update(self.checksums.covered())
        real_check(self)

    def recording_ranges(file: Path, size: int, known: Any) -> tuple[int, str]:
        completed.append(Path(file).name)
        return real_ranges(file, size, known)

    integrity.ReadVerification.check = recording_check  # type: ignore[method-assign]
    local.ranges_checksum = recording_ranges  # type: ignore[assignment]
    for name in ("during", "during-damaged", "before-damaged"):
        if name == "during-damaged" and rank == 1:
            with open(ckpt / "__1_0.distcp", "r+b") as f:  # the middle of rank 1's shard: its tensor's bytes
                f.seek((ckpt / "__1_0.distcp").stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 1]))
        dist.barrier()
        covered.clear()
        completed.clear()
        loaded = module(1)
        mode: Any = True if name == "before-damaged" else "during"  # the flipped byte is still there
        try:
            restored = load.restore_checkpoint(ckpt, loaded, verify=mode)
            results[name] = {"type": None, "step": restored.metadata.get("global_step")}
            if restored.found.manifest is not None:  # what this rank was sent of the manifest
                results[name]["files"] = sorted(e.path for e in restored.found.manifest.files)
        except Exception as err:
            results[name] = {"type": type(err).__name__, "message": str(err)}
        weight = loaded.weight
        assert isinstance(weight, DTensor)
        results[name]["covered"] = dict(covered)
        results[name]["completed"] = list(completed)
        results[name]["equal"] = bool(torch.equal(weight.to_local(), saved.weight.to_local()))  # type: ignore[union-attr]
        results[name]["unchanged"] = bool(torch.equal(weight.to_local(), module(1).weight.to_local()))  # type: ignore[union-attr]
        dist.barrier()
    integrity.ReadVerification.check = real_check  # type: ignore[method-assign]
    local.ranges_checksum = real_ranges  # type: ignore[assignment]


def bounded_groups(rank: int) -> dict[str, Any]:
    """The checkpoint's bounded groups: made once per role and timeout, then reused; replaced on every
    rank when a collective on one failed on one rank only (rank 1 gives up on it here)."""
    from lightning_sharded.checkpoint import collective, presence

    first = collective.bounded_group(30.0)
    found: dict[str, Any] = {
        "reused": collective.bounded_group(30.0) is first,
        "background apart": collective.bounded_group(30.0, background=True) not in (first, None),
        "background reused": collective.bounded_group(30.0, background=True)
        is collective.bounded_group(30.0, background=True),
        "other timeout apart": collective.bounded_group(31.0) is not first,
    }
    if rank == 1:
        presence.lost(first, RuntimeError("Connection closed by peer (injected)"))
    replaced = collective.bounded_group(30.0)
    found["replaced"] = replaced is not first
    found["replacement works"] = collective.all_true(True, collective.ranks(replaced))
    found["replacement reused"] = collective.bounded_group(30.0) is replaced
    return found


def missing_file(out: Path, rank: int) -> dict[str, Any]:
    """``verify``: a file of rank 0's is missing, one that rank 1 (which checks only its own files'
    presence) has in its share of the checksums; both must name it, neither may leave the other waiting
    (the check runs on a 15 s group: rank 0 waits that long if rank 1 raises alone)."""
    from lightning_sharded.checkpoint import collective
    from lightning_sharded.checkpoint.integrity import split_by_size

    torch.manual_seed(0)
    ckpt = out / "missing"
    save.write_sharded_checkpoint(
        ckpt, {"model": nn.Linear(64, 64).state_dict()}, {"global_step": 3}, rank=rank
    )
    dist.barrier()
    manifest = detect(ckpt).manifest
    assert manifest is not None
    needed = (names.DCP_METADATA, names.LIGHTNING_METADATA)  # what finding the checkpoint reads
    gone = [e.path for e in split_by_size(list(manifest.files), 2)[1] if e.rank != 1 and e.path not in needed]
    if rank == 0 and gone:
        (ckpt / gone[0]).unlink()
    dist.barrier()
    found: dict[str, Any] = {"gone": gone[:1]}
    start = time.perf_counter()
    try:
        check_found(detect(ckpt), verify=True, group=collective.bounded_group(15.0))
        found["type"] = None
    except Exception as err:
        found.update(type=type(err).__name__, message=str(err))
    found["seconds"] = time.perf_counter() - start
    dist.barrier()
    return found


def shares_that_fail_midway() -> dict[str, Any]:
    """``collective.decide_each`` whose check fails while its values are taken (a generator that raises
    after rank 0's value): every rank raises rank 0's error, none waits in the scatter."""

    def shares(world_size: int) -> Any:
        yield "rank 0's share"
        raise ValueError("the share of rank 1 could not be computed")

    try:
        return {"value": collective.decide_each(shares, step="shares")}
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err)}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    ckpt = out / "ckpt"
    save.write_sharded_checkpoint(
        ckpt, {"model": model.state_dict()}, {"global_step": 3, "epoch": 0}, rank=rank
    )
    full = out / "full.ckpt"
    save.write_full_checkpoint(full, {"state_dict": model.state_dict(), "global_step": 3}, rank=rank)
    dist.barrier()
    results: dict[str, Any] = {}
    backend = local.LocalBackend
    real_torch_load, real_list_files, real_checksum = backend.torch_load, backend.list_files, backend.checksum
    checksummed: list[str] = []

    def case(name: str, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            if kwargs.pop("check", False):
                check_found(detect(ckpt), verify=True)
            restored = load.restore_checkpoint(kwargs.pop("path", ckpt), nn.Linear(64, 64), **kwargs)
            results[name] = {"type": None, "step": restored.metadata.get("global_step")}
            if restored.found.manifest is not None:  # what this rank was sent of the manifest
                results[name]["files"] = sorted(e.path for e in restored.found.manifest.files)
        except Exception as err:
            results[name] = {"type": type(err).__name__, "message": str(err)}
        results[name]["seconds"] = time.perf_counter() - start
        dist.barrier()

    def broken_meta(self: Any, loc: Any, **kwargs: Any) -> Any:
        if Path(loc).name == "meta.pt":
            raise OSError(5, "Input/output error (injected)")
        return real_torch_load(self, loc, **kwargs)

    if rank == 0:
        backend.torch_load = broken_meta  # type: ignore[method-assign]
    case("meta")
    backend.torch_load = broken_meta if rank == 1 else real_torch_load  # type: ignore[method-assign]
    case("meta-other")
    backend.torch_load = real_torch_load  # type: ignore[method-assign]

    def stale_listing(self: Any, loc: Any) -> dict[str, int]:
        files = real_list_files(self, loc)
        files.pop("__1_0.distcp", None)
        return files

    real_size = backend.size

    def stale_size(self: Any, loc: Any) -> int:
        if Path(loc).name == "__1_0.distcp":
            raise FileNotFoundError(loc)
        return real_size(self, loc)

    # Rank 1's view of its own shard is stale (an NFS attribute cache): it lists and stats it missing.
    if rank == 1:
        backend.list_files = stale_listing  # type: ignore[method-assign]
        backend.size = stale_size  # type: ignore[method-assign]
    case("shard")
    backend.list_files, backend.size = real_list_files, real_size  # type: ignore[method-assign]

    def counting(self: Any, loc: Any) -> tuple[int, str]:
        checksummed.append(Path(loc).name)
        return real_checksum(self, loc)

    backend.checksum = counting  # type: ignore[method-assign]
    if rank == 0:
        with open(ckpt / "__0_0.distcp", "r+b") as f:  # same size, other bytes
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    # The checksum pass before a read (object storage's verify=True; local loads check from their reads).
    case("verify", check=True)
    results["checksummed"] = checksummed
    backend.checksum = real_checksum  # type: ignore[method-assign]

    during_cases(out, rank, results)

    real_torch_load_fn = torch.load
    if rank == 1:
        real_load = torch.load

        def broken_load(f: Any, *args: Any, **kwargs: Any) -> Any:
            if str(f).endswith("full.ckpt"):
                raise OSError(5, "Input/output error (injected)")
            return real_load(f, *args, **kwargs)

        torch.load = broken_load  # type: ignore[assignment]
    case("full", path=full)
    torch.load = real_torch_load_fn  # type: ignore[assignment]
    assert sharded  # imported for the monkeypatching targets above

    entries = [rank_state.collect({}, rank=r, world_size=2) for r in range(2)]
    entries[1]["rank"] = 0  # rank 1's entry is not its own; rank 0's is fine
    metadata = {names.RANK_STATE_KEY: {"format": rank_state.FORMAT, "world_size": 2, "ranks": entries}}
    try:
        rank_state.restore(
            metadata, detect(full), rank=rank, world_size=2, weights_only=True, path="full.ckpt"
        )
        results["rank-state"] = {"type": None}
    except Exception as err:
        results["rank-state"] = {"type": type(err).__name__, "message": str(err)}
    # What the full file's entry is (here its world size) is rank 0's decision: rank 1 reads another
    # world size in its copy, and takes rank 0's branch all the same (alone, it would skip a collective).
    entries = [rank_state.collect({}, rank=r, world_size=2) for r in range(2)]
    seen = {"format": rank_state.FORMAT, "world_size": 2 if rank == 0 else 1, "ranks": entries}
    try:
        outcome = rank_state.restore(
            {names.RANK_STATE_KEY: seen},
            detect(full),
            rank=rank,
            world_size=2,
            weights_only=True,
            path="full.ckpt",
        )
        results["rank-state-world"] = {"warning": outcome.warning, "rng": outcome.rng is not None}
    except Exception as err:
        results["rank-state-world"] = {"type": type(err).__name__, "message": str(err)}
    dist.barrier()
    results["full-gather"] = full_gathers()
    results["groups"] = bounded_groups(rank)
    results["verify-missing"] = missing_file(out, rank)
    results["decide-each"] = shares_that_fail_midway()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main(Path(sys.argv[1]))
