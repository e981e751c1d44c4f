"""A sharded checkpoint of a model (and its optimizers) saved in one plain process, as the strategies'
save writes it on every rank: the setup several in-process load tests share."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from lightning_sharded.checkpoint import save, state_dicts


def stepped(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: int) -> None:
    """One optimizer step on a random batch of 2, so the optimizer has its state."""
    model(torch.randn(2, inputs)).sum().backward()
    optimizer.step()


def save_sharded(
    path: Path,
    model: nn.Module,
    *optimizers: torch.optim.Optimizer,
    model_key: str = "state_dict",
    global_step: int = 1,
) -> Path:
    """``model`` (and ``optimizers``) saved at ``path`` as a sharded directory, by rank 0 alone."""
    checkpoint = {
        "state_dict": state_dicts.model_state_dict(model, full=False),
        "optimizer_states": [state_dicts.optimizer_state_dict(model, o, full=False) for o in optimizers],
        "global_step": global_step,
    }
    if not optimizers:
        del checkpoint["optimizer_states"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming ... a single process"
        save.save_checkpoint(path, checkpoint, sharded=True, model_key=model_key, rank=0)
    return path
