"""training.tp > 1 for Hugging Face models: the config's base_model_tp_plan shards each decoder
layer (q/k/v and gate/up by columns, o and down by rows; Qwen3's per-head q/k norms replicated
with their gradients summed over the unit) over a unit of two cards, and training equals
single-process training (float64, rtol 1e-9, AdamW, clipping; Llama with a tied embedding). From
that sharded plan, save_pretrained writes a directory transformers loads with the trained
weights, and the offline converter turns the job's checkpoint into the same directory."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.runtime import PipelineTrainer, save_checkpoint
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

TP, MBS, STEPS, CLIP = 2, 2, 3, 0.5


def _model(directory: str):
    import torch

    from chameleon_elastic.models import hf

    return hf.causal_lm(directory, dtype=torch.float64, context=16,
                        make_optimizer=functools.partial(hf.adamw, lr=1e-2))


def _plan() -> ExecutionPlan:
    return ExecutionPlan("initial", 0, (Pipeline((0, 1), ((0, 2), (2, 4)), 4),)).validate()


def _train(rank: int, world: int, directory: str, out: str):
    from chameleon_elastic.models import hf

    plan = _plan()
    ranks = dense_rank_map(plan, TP)
    trainer = PipelineTrainer(_model(directory), plan, ranks.device_of_rank[rank],
                              micro_batch_size=MBS, max_grad_norm=CLIP,
                              tp_rank=ranks.tp_rank_of_rank[rank], tp_size=TP)
    losses = [trainer.step(t).loss for t in range(STEPS)]
    shapes = {name: tuple(p.to_local().shape) for m in trainer.layers.values()
              for name, p in m.named_parameters() if hasattr(p, "to_local")}
    hf.save_pretrained(trainer, f"{out}/export")
    save_checkpoint(trainer, f"{out}/ckpt", STEPS)
    trainer.close()
    return losses, shapes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_tensor_parallel_units_train_as_one_process_and_export(tiny_dirs, tmp_path, name):
    import torch
    from transformers import AutoModelForCausalLM

    from chameleon_elastic.models import hf
    from chameleon_elastic.models.toy import reference_run

    directory = str(tiny_dirs(name, layers=2))
    results = run_local_world(_train, 2 * TP, directory, str(tmp_path), timeout_s=110)
    ref = reference_run(_model(directory), STEPS, 4, MBS, max_grad_norm=CLIP)
    assert max(ref.grad_norms) > CLIP
    for losses, shapes in results:
        np.testing.assert_allclose(losses, ref.losses, rtol=1e-9)
    sharded = results[2][1]   # card 0 of unit 1: layers 2-3
    assert sharded["model.layers.1.self_attn.q_proj.weight"] == (16, 32)   # half the heads
    assert sharded["model.layers.1.mlp.down_proj.weight"] == (32, 32)      # half the inputs
    # qwen3's per-head q/k norms stay whole on each card (their gradients are summed)
    want = {k: v for m in ref.layers for k, v in m.state_dict().items()}
    hf.convert_checkpoint(tmp_path / "ckpt", directory, tmp_path / "converted")
    for where in ("export", "converted"):
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / where),
                                                      dtype=torch.float64).state_dict()
        for key, value in loaded.items():
            np.testing.assert_allclose(value.numpy(), want[key].detach().numpy(), rtol=1e-9,
                                       atol=1e-12, err_msg=f"{where}: {key}")
