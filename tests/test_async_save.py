"""``async_save=True`` on both strategies, with real ranks (``tests/distributed/scenario_async.py``).

- an async-saved checkpoint holds exactly what a synchronous save of the same state holds (on disk, and
  after a resume), although training changed the model while it was written;
- an error of the background write is raised in the training process (next save, end of fit) and the
  previous checkpoint stays;
- a rank SIGKILLed while the background write is in flight leaves the previous checkpoint whole.
No timing assertions.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sharded._launch import free_port
from lightning_sharded.checkpoint import read_manifest
from lightning_sharded.checkpoint.async_save import AsyncSaver
from lightning_sharded.checkpoint.checksum import file_checksum
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.staging import StagingBuffers
from tests._compare import assert_restored
from tests.distributed.launch import Rank, rank_env, run_ranks, start_rank

SCENARIO = Path(__file__).with_name("distributed") / "scenario_async.py"
MODEL_KEY = {"mp": "state_dict", "fsdp": "model"}


def read_values(path: Path, strategy: str) -> dict[str, torch.Tensor]:
    """A sharded checkpoint read in this process, named like the scenario's ``full_values``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent / f"{path.name}.flat.pt"
    dcp_to_torch_save(path, flat)
    ckpt = torch.load(flat, weights_only=False)
    values = {f"model.{k}": v for k, v in ckpt[MODEL_KEY[strategy]].items()}
    for name, state in ckpt["optimizer_0"]["state"].items():
        for entry, value in state.items():
            values[f"optim.{name}.{entry}"] = torch.as_tensor(value)
    return values


def assert_whole(path: Path) -> None:
    manifest = read_manifest(path)
    assert manifest is not None, f"no manifest in {path}"
    for entry in manifest.files:
        assert file_checksum(path / entry.path) == (entry.size, entry.checksum), entry.path


@pytest.fixture(scope="module", params=["mp", "fsdp"])
def main_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Any]:
    strategy = request.param
    root = tmp_path_factory.mktemp(f"async-{strategy}")
    run_ranks(SCENARIO, 2, "main", "--dir", str(root), "--strategy", strategy, timeout=150)
    return strategy, root, torch.load(root / "main.rank0.pt", weights_only=False)


@pytest.mark.slow
def test_async_checkpoint_equals_sync_checkpoint(main_run: tuple[str, Path, Any]) -> None:
    strategy, root, result = main_run
    saved = result["saved"]
    # Training went on while the async one was written: the model moved away from what was saved.
    assert not all(
        torch.equal(saved[k], result["after_training"][k]) for k in saved if k.startswith("model.")
    )
    assert result["deferred bytes"] > 0  # the optimizer state's copy was deferred to the next step
    on_disk_async = read_values(root / "async", strategy)
    assert_restored(saved, on_disk_async, step=False)
    assert_whole(root / "async")


@pytest.mark.slow
def test_resume_from_async_equals_resume_from_sync(main_run: tuple[str, Path, Any]) -> None:
    _, _, result = main_run
    assert_restored(result["saved"], result["resumed_async"], step=False)
    assert_restored(
        result["resumed_sync"], result["resumed_async"], sorted(result["resumed_sync"]), step=False
    )


@pytest.mark.slow
def test_background_error_is_raised_in_training_and_keeps_the_old_checkpoint(
    main_run: tuple[str, Path, Any],
) -> None:
    strategy, root, result = main_run
    for where in ("next_save_error", "teardown_error"):
        message = result[where]
        assert message is not None, f"the failed background write was not raised ({where})"
        # The cause first, as for a synchronous save (a StorageError is a CheckpointError and an OSError)
        assert message.startswith("StorageError: No space left on device (ENOSPC): saving the checkpoint"), (
            message
        )
        assert "No space left on device (injected)" in message, message
        assert "(The background save of the checkpoint" in message, message
    # Both failed writes went to `sync`: it still is the complete checkpoint saved at step 2.
    assert_whole(root / "sync")
    assert_restored(result["saved"], read_values(root / "sync", strategy), step=False)
    assert not list(root.glob(".sync.staging-*")), "a failed save left its staging directory"


@pytest.mark.slow
def test_a_registered_state_that_fails_on_one_rank_fails_the_next_save_on_every_rank(
    main_run: tuple[str, Path, Any],
) -> None:
    strategy, root, _ = main_run
    for rank in range(2):
        result = torch.load(root / f"main.rank{rank}.pt", weights_only=False)
        # The async save itself returned on both ranks: it took no collective in the training thread.
        assert result["registered_save_error"] is None, result["registered_save_error"]
        message = result["registered_next_error"]
        assert message is not None, f"rank {rank}: the failed collection was never raised"
        assert "'mix' could not be saved: its state_dict() raised ValueError: not now" in message, message
        assert "(The background save of the checkpoint" in message, message
    assert_whole(root / "sync")  # nothing of that save was written over the complete checkpoint
    assert not torch.load(root / "main.rank0.pt", weights_only=False)["other before"]
    assert_whole(root / "other")  # written by the save after the object was mended
    saved = torch.load(root / "main.rank0.pt", weights_only=False)["saved"]
    assert_restored(saved, read_values(root / "sync", strategy), step=False)


def _start_ranks(args: list[str]) -> list[Rank]:
    port = free_port()
    return [start_rank([str(SCENARIO), *args], rank_env(rank, 2, port)) for rank in range(2)]


@pytest.mark.slow
def test_kill_during_background_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    procs = _start_ranks(["kill", "--dir", str(tmp_path), "--strategy", "mp"])
    deadline = time.monotonic() + 120
    while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)  # what the survivor does in the meantime must not matter either
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    outputs = [p.communicate()[0] for p in procs]
    assert procs[1].returncode == -signal.SIGKILL, outputs[1][-3000:]
    saved = torch.load(tmp_path / "kill.rank0.pt", weights_only=False)["v1"]
    assert_whole(tmp_path / "kill")
    assert_restored(saved, read_values(tmp_path / "kill", "mp"), step=False)


# ------------------------------------------------------------------------------- in one process


def test_staging_reuses_buffers_and_isolates_from_later_changes() -> None:
    buffers = StagingBuffers()
    state = {"a": torch.arange(6.0), "nested": [{"b": torch.ones(2, 2)}, 3], "s": "text"}
    staged = buffers.stage(state)
    first_ptr = staged["a"].data_ptr()
    state["a"].add_(1)
    assert torch.equal(staged["a"], torch.arange(6.0))
    again = buffers.stage(state)
    assert again["a"].data_ptr() == first_ptr and buffers.allocated_bytes == 0
    assert torch.equal(again["a"], torch.arange(6.0) + 1)
    assert again["nested"][1] == 3 and again["s"] == "text"


def _trained_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save_optimizer_state(
    saver: AsyncSaver, optimizer: torch.optim.Optimizer, path: Path, write: Any
) -> None:
    """``saver.save`` of the optimizer's live state dict, its ``state`` deferred."""
    state = {"optimizer_0": optimizer.state_dict()}
    saver.save(path, state, write, defer=[("optimizer_0", "state")], optimizers=[optimizer])


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()


def test_deferred_optimizer_state_is_copied_before_the_next_step(tmp_path: Path, monkeypatch: Any) -> None:
    """The optimizer's state is copied after save() returns; its next step() waits for the copy."""
    model, optimizer = _trained_adam()
    expected = {
        i: {k: v.clone() for k, v in entries.items()}
        for i, entries in optimizer.state_dict()["state"].items()
    }
    original = StagingBuffers.copy_deferred

    def slow(self: StagingBuffers) -> None:
        time.sleep(0.5)  # a step right after save() would change the state before this copy
        original(self)

    monkeypatch.setattr(StagingBuffers, "copy_deferred", slow)
    written: dict[str, Any] = {}
    saver = AsyncSaver()
    saver.follow([optimizer])
    state = {"optimizer_0": optimizer.state_dict(), "model": model.state_dict()}  # the live tensors
    saver.save(
        tmp_path / "c",
        state,
        lambda path, staged, group: written.update(staged=staged),
        defer=[("optimizer_0", "state")],
        optimizers=[optimizer],
    )
    assert saver.buffers.deferred_bytes == 2 * 257 * 256 * 4 + 2 * 4  # exp_avg, exp_avg_sq, steps
    _step(model, optimizer)  # waits for the deferred copies
    saver.wait()
    staged = written["staged"]["optimizer_0"]["state"]
    for index, entries in expected.items():
        for key, value in entries.items():
            assert torch.equal(staged[index][key], value), (index, key)
    assert not torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], expected[0]["exp_avg"])
    assert len(optimizer._optimizer_step_pre_hooks) == 1  # the save's hook went once waited for
    saver.close()
    assert not optimizer._optimizer_step_pre_hooks  # and the saver's own, counting steps


@pytest.mark.parametrize("passed", ["positional", "keyword"])
def test_with_a_closure_the_step_waits_after_it(tmp_path: Path, monkeypatch: Any, passed: str) -> None:
    """Lightning runs the training step in the closure: the copy goes on meanwhile, the update waits."""
    model, optimizer = _trained_adam()
    live = optimizer.state_dict()["state"]
    expected = {i: {k: v.clone() for k, v in entries.items()} for i, entries in live.items()}
    events: list[str] = []
    original = StagingBuffers.copy_deferred

    def slow(self: StagingBuffers) -> None:
        time.sleep(0.5)
        original(self)
        events.append("copied")

    monkeypatch.setattr(StagingBuffers, "copy_deferred", slow)
    written: dict[str, Any] = {}
    saver = AsyncSaver()
    saver.follow([optimizer])
    _save_optimizer_state(
        saver, optimizer, tmp_path / "c", lambda path, staged, group: written.update(staged=staged)
    )

    def closure() -> torch.Tensor:
        events.append("closure")
        loss = model(torch.randn(4, 256)).sum()
        loss.backward()
        return loss

    if passed == "positional":
        optimizer.step(closure)
    else:
        optimizer.step(closure=closure)
    saver.wait()
    assert events == ["closure", "copied"]  # the closure ran while the copy went on
    staged = written["staged"]["optimizer_0"]["state"]
    assert all(torch.equal(staged[i][k], v) for i, entries in expected.items() for k, v in entries.items())
    assert not torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], expected[0]["exp_avg"])


def test_a_save_from_inside_a_step_copies_the_optimizer_state_at_once(tmp_path: Path) -> None:
    """A checkpoint saved in the training step (the closure) is followed by that step's update."""
    model, optimizer = _trained_adam()
    expected = {i: {k: v.clone() for k, v in e.items()} for i, e in optimizer.state_dict()["state"].items()}
    saver = AsyncSaver()
    written: dict[str, Any] = {}

    def closure() -> torch.Tensor:
        _save_optimizer_state(
            saver, optimizer, tmp_path / "c", lambda path, staged, group: written.update(staged=staged)
        )
        loss = model(torch.randn(4, 256)).sum()
        loss.backward()
        return loss

    unfollowed = AsyncSaver()
    unfollowed.save(
        tmp_path / "d", {"x": torch.ones(3)}, lambda *a: None, defer=[("x",)], optimizers=[optimizer]
    )
    assert unfollowed.buffers.deferred_bytes == 0  # not followed: nothing deferred
    unfollowed.close()
    saver.follow([optimizer])
    optimizer.step(closure)
    assert saver.buffers.deferred_bytes == 0  # inside step(): copied before save() returned
    saver.wait()
    staged = written["staged"]["optimizer_0"]["state"]
    assert all(torch.equal(staged[i][k], v) for i, entries in expected.items() for k, v in entries.items())
    _save_optimizer_state(saver, optimizer, tmp_path / "c", lambda *a: None)
    assert saver.buffers.deferred_bytes > 0  # between steps: deferred again
    saver.close()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_a_failed_deferred_copy_fails_the_save_not_the_step(tmp_path: Path, monkeypatch: Any) -> None:
    model, optimizer = _trained_adam()

    def broken(self: StagingBuffers) -> None:
        raise RuntimeError("copy failed (injected)")

    monkeypatch.setattr(StagingBuffers, "copy_deferred", broken)
    saver = AsyncSaver()
    saver.follow([optimizer])
    written: list[Any] = []
    _save_optimizer_state(saver, optimizer, tmp_path / "c", lambda *args: written.append(args))
    _step(model, optimizer)  # does not hang
    with pytest.raises(CheckpointError, match="copy failed"):
        saver.wait()
    assert not written and len(optimizer._optimizer_step_pre_hooks) == 1
    saver.close()


def test_a_watched_tensor_changed_in_place_before_its_copy_fails_the_save(
    tmp_path: Path, monkeypatch: Any
) -> None:
    model, optimizer = _trained_adam()
    changed = threading.Event()
    original = StagingBuffers.copy_deferred

    def after_the_change(self: StagingBuffers) -> None:
        changed.wait(5)  # the copy runs only once the parameter was changed
        original(self)

    monkeypatch.setattr(StagingBuffers, "copy_deferred", after_the_change)
    saver = AsyncSaver()
    saver.follow([optimizer])
    params = list(model.parameters())
    written: list[Any] = []

    def save() -> None:
        state = {"model": dict(model.state_dict()), "optimizer_0": optimizer.state_dict()}
        saver.save(
            tmp_path / "w",
            state,
            lambda *a: written.append(a),
            defer=[("model",)],
            optimizers=[optimizer],
            watch=params,
        )

    save()
    with torch.no_grad():
        params[0].mul_(2)  # not in step(), before the copy
    changed.set()
    with pytest.raises(CheckpointError, match="changed in place"):
        saver.wait()
    assert not written
    save()
    _step(model, optimizer)  # a step waits for the copies: allowed
    saver.wait()
    assert written
    saver.close()


def test_saver_raises_the_background_error_once_and_names_the_path(tmp_path: Path) -> None:
    saver = AsyncSaver()

    def failing(path: Path, state: Any, group: Any) -> None:
        raise OSError(28, "No space left on device")

    saver.save(tmp_path / "ckpt", {"x": torch.zeros(3)}, failing)
    with pytest.raises(CheckpointError, match=r"ckpt.*No space left on device"):
        saver.save(tmp_path / "next", {"x": torch.zeros(3)}, failing)
    # The second save was not started: nothing in flight, nothing more to raise.
    assert saver.in_flight is None
    saver.close()


def test_saver_close_waits_and_raises(tmp_path: Path) -> None:
    saver = AsyncSaver()
    written: list[Path] = []

    def slow(path: Path, state: Any, group: Any) -> None:
        time.sleep(0.2)
        written.append(path)

    saver.save(tmp_path / "a", {"x": torch.zeros(3)}, slow)
    saver.close()
    assert written == [tmp_path / "a"]


def test_a_removal_queued_after_a_save_runs_after_it_and_never_after_a_failed_one(tmp_path: Path) -> None:
    # ModelCheckpoint(save_top_k=1) saves the new checkpoint, then removes the previous one: with
    # async_save the removal is queued behind the save. It must see the save published, and a save that
    # failed must leave the previous checkpoint in place (nothing valid destroyed by a failed save).
    saver = AsyncSaver()
    events: list[str] = []

    def slow(path: Path, state: Any, group: Any) -> None:
        time.sleep(0.1)
        events.append(f"saved {path.name}")

    def failing(path: Path, state: Any, group: Any) -> None:
        raise OSError(28, "No space left on device")

    saver.save(tmp_path / "new", {"x": torch.zeros(3)}, slow)
    saver.later(lambda: events.append("removed old"), "removing 'old'")
    saver.wait()
    assert events == ["saved new", "removed old"]

    saver.save(tmp_path / "newer", {"x": torch.zeros(3)}, failing)
    saver.later(lambda: events.append("removed new"), "removing 'new'")
    with pytest.raises(CheckpointError, match=r"newer.*No space left on device"):
        saver.wait()
    assert events == ["saved new", "removed old"]  # 'new' stays: the save meant to replace it failed

    # A save after the failure queues and runs its removal again.
    saver.save(tmp_path / "newest", {"x": torch.zeros(3)}, slow)
    saver.later(lambda: events.append("removed new"), "removing 'new'")
    saver.wait()
    assert events[-2:] == ["saved newest", "removed new"]

    def broken() -> None:
        raise PermissionError(13, "Permission denied", "old")

    saver.later(broken, "removing 'old'")
    with pytest.raises(CheckpointError, match=r"In the background, removing 'old' failed.*Permission denied"):
        saver.wait()
    saver.close()


def test_savers_of_one_process_write_one_at_a_time_in_the_order_they_were_started(tmp_path: Path) -> None:
    # Every saver's background writes share one process group (collective.bounded_group): a second
    # Trainer's save must not start writing while the first Trainer's save after fit still writes, or
    # their collectives could interleave in another order on another rank. The first save's error is
    # its own: the second save starts all the same, and the first saver's wait raises it.
    first, second = AsyncSaver("first"), AsyncSaver("second")
    events: list[str] = []
    release = threading.Event()

    def held(path: Path, state: Any, group: Any) -> None:
        release.wait(10)
        events.append(f"written {path.name}")
        raise OSError(28, "No space left on device")

    def write(path: Path, state: Any, group: Any) -> None:
        events.append(f"started {path.name}")

    first.save(tmp_path / "a", {"x": torch.zeros(3)}, held)
    threading.Timer(0.3, release.set).start()
    second.save(tmp_path / "b", {"x": torch.zeros(3)}, write)
    second.close()
    assert events == ["written a", "started b"]
    with pytest.raises(CheckpointError, match=r"No space left on device"):
        first.close()


def test_only_what_the_optimizers_update_is_deferred() -> None:
    # The model-state entries an async save copies after it returns: the trainable parameters' memory
    # (views of it too), never buffers, frozen parameters or tensors of their own.
    from lightning_sharded.checkpoint.save import _updated_by

    model = nn.Module()
    model.trained = nn.Linear(4, 4)
    model.frozen = nn.Linear(4, 4).requires_grad_(False)
    model.register_buffer("running", torch.zeros(4))
    optimizer = torch.optim.Adam(model.parameters())
    state = dict(model.state_dict())
    state["view"] = model.trained.weight.detach()[1:3]  # a view of a trained parameter's memory
    state["copy"] = model.trained.weight.detach().clone()  # equal values, its own memory
    assert _updated_by(state, [optimizer]) == ["trained.bias", "trained.weight", "view"]


def test_a_load_waits_for_another_savers_save_to_its_path_only(tmp_path: Path) -> None:
    # A new Trainer's strategy loads what the previous Trainer's strategy still writes in the background.
    from lightning_sharded.checkpoint.async_save import wait_for_saves_to

    release = threading.Event()
    written: list[Path] = []

    def blocked(path: Path, state: Any, group: Any) -> None:
        assert release.wait(30)
        written.append(path)

    def failing(path: Path, state: Any, group: Any) -> None:
        raise OSError(28, "No space left on device")

    first, second = AsyncSaver(), AsyncSaver()
    first.save(tmp_path / "a", {"x": torch.zeros(3)}, blocked)
    wait_for_saves_to(tmp_path / "other")  # another path: returns at once
    assert first.writing
    threading.Timer(0.3, release.set).start()
    wait_for_saves_to(Path(os.path.relpath(tmp_path / "a")))  # the same path, spelled another way
    assert written == [tmp_path / "a"]
    assert first.in_flight is None  # waited for: nothing left to raise
    second.save(tmp_path / "b", {"x": torch.zeros(3)}, failing)
    with pytest.raises(CheckpointError, match=r"'.*b'.*No space left on device"):
        wait_for_saves_to(tmp_path / "b")
    wait_for_saves_to(tmp_path / "b")  # raised once
    first.close()
    second.close()


def test_close_stops_the_background_threads(tmp_path: Path) -> None:
    saver = AsyncSaver("closing-test")
    saver.save(tmp_path / "a", {"x": torch.zeros(3)}, lambda path, state, group: None)
    assert [t for t in threading.enumerate() if t.name.startswith("closing-test")]
    saver.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("closing-test")]
    assert left == [], left


def test_an_optimizer_without_step_hooks_is_followed_without_error(tmp_path: Path) -> None:
    class Plain:  # an optimizer-like object that is not torch's (no step hooks)
        param_groups: list[dict[str, Any]] = []
        state: dict[Any, Any] = {}

    saver = AsyncSaver()
    saver.follow([Plain()])  # type: ignore[list-item]
    saver.save(tmp_path / "a", {"x": torch.zeros(3)}, lambda path, state, group: None)
    saver.close()
