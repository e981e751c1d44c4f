"""A real transformer in the suite: Hugging Face's ``LlamaForCausalLM`` from a tiny ``LlamaConfig``.

Jobs of ``scenario_wrapping.py``. ``llama-fit`` trains it under ``ShardedModelParallelStrategy`` with
Colwise/Rowwise tensor-parallel plans on the attention and MLP projections and ``fully_shard`` per
decoder layer and at the root (a ``data_parallel`` x ``tensor_parallel`` mesh), plus two sharded
attributes in decoder layers (a ``DTensor`` on the world mesh and one on the tensor-parallel mesh),
saves, and writes the full values. ``llama-resume`` restores that checkpoint into another layout (any
``data_parallel`` x ``tensor_parallel`` sizes, or FSDP1 with one unit per decoder layer) and writes
the full values right after the restore.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy, ShardedStateMixin
from lightning_sharded.tensors import to_full
from tests._compare import quiet_trainer
from tests.distributed.wrap_models import full_state_values

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
VOCAB, SEQ = 64, 8

PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


class LlamaModule(ShardedStateMixin, L.LightningModule):
    def __init__(self, fsdp1: bool = False) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.fsdp1 = fsdp1
        torch.manual_seed(0)
        self.llm = LlamaForCausalLM(config())
        for layer in self.llm.model.layers:
            layer.router_table = None  # DTensor over every rank
            layer.tp_scale = None  # DTensor over the tensor-parallel ranks (all ranks under FSDP1)

    def layers(self) -> list[nn.Module]:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return [m for m in self.modules() if isinstance(m, LlamaDecoderLayer)]

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        world_mesh = init_device_mesh("cpu", (WORLD,))
        tp_mesh = world_mesh if self.fsdp1 else self.device_mesh["tensor_parallel"]
        for index, layer in enumerate(self.layers()):
            if layer.router_table is None:
                value = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + 100 * index
                layer.router_table = distribute_tensor(value, world_mesh, [Shard(0)], src_data_rank=None)
            if layer.tp_scale is None:
                value = torch.linspace(0, 1, 4 * 6).reshape(4, 6) + index
                layer.tp_scale = distribute_tensor(value, tp_mesh, [Shard(1)], src_data_rank=None)
        if self.fsdp1:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if isinstance(self.llm, FSDPModule):
            return
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        dp_mesh = self.device_mesh["data_parallel"]
        for layer in self.llm.model.layers:
            parallelize_module(layer, tp_mesh, {name: styles[style]() for name, style in PLAN.items()})
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.llm, mesh=dp_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.llm(input_ids=ids, labels=ids).loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for layer in self.layers():
                layer.router_table.to_local().add_(1.0)
                layer.tp_scale.to_local().mul_(2.0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        ids = torch.randint(0, VOCAB, (8, SEQ), generator=generator)
        return DataLoader(TensorDataset(ids), batch_size=2)


def strategy(layout: str) -> Any:
    if layout == "fsdp1":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return ShardedFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})
    dp, tp = (int(n) for n in layout.split("x"))
    assert dp * tp == WORLD, f"layout {layout} needs {dp * tp} processes, not {WORLD}"
    return ShardedModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)


def full_values(trainer: L.Trainer, model: LlamaModule) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    values = full_state_values(trainer, lambda key: key.endswith((".router_table", ".tp_scale")))
    q_proj = model.llm.model.layers[0].self_attn.q_proj.weight
    values["info.q_proj_placements"] = str(q_proj.placements) if isinstance(q_proj, DTensor) else "plain"
    for index, layer in enumerate(model.layers()):
        values[f"attr.{index}.router_table"] = to_full(layer.router_table).clone()
        values[f"attr.{index}.tp_scale"] = to_full(layer.tp_scale).clone()
    return values


class Capture(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        values = full_values(trainer, pl_module)
        if RANK == 0:
            torch.save(values, self.out)


def trainer(layout: str, steps: int, callbacks: list[Any]) -> L.Trainer:
    return quiet_trainer(callbacks, devices=WORLD, strategy=strategy(layout), max_steps=steps)


def fit(job: dict[str, Any]) -> None:
    model = LlamaModule()
    t = trainer(job["layout"], 2, [])
    t.fit(model)
    t.save_checkpoint(job["ckpt"])
    values = full_values(t, model)
    if RANK == 0:
        torch.save(values, job["out"])


def resume(job: dict[str, Any]) -> None:
    model = LlamaModule(fsdp1=job["layout"] == "fsdp1")
    trainer(job["layout"], 3, [Capture(job["out"])]).fit(model, ckpt_path=job["ckpt"])


JOBS = {"llama-fit": fit, "llama-resume": resume}
if not dist.is_available():  # pragma: no cover - torch without distributed
    JOBS = {}
