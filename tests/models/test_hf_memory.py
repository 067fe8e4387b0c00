"""A stage reads only its own layers' tensors from the safetensors files.

Four gloo processes train a tiny Llama (tied embeddings, sharded checkpoint) under 2 pipelines x
2 stages. Each records every tensor name it read: exactly the tensors of its layers (the head's
holder also reads the embedding, which a tied checkpoint stores once for both), never another
stage's, although every process sizes its stage boundary by building the layers before it."""

from __future__ import annotations

import pytest

from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

LAYERS = 6   # embedding, 4 decoder layers, head


def _plan() -> ExecutionPlan:
    return ExecutionPlan("initial", 0, tuple(
        Pipeline((2 * p, 2 * p + 1), ((0, 3), (3, LAYERS)), 2) for p in range(2))).validate()


def _train_and_list_reads(rank: int, world: int, directory: str, plan_json: str):
    from chameleon_elastic.models import hf
    from chameleon_elastic.models.hf_weights import clear_reads, tensors_read

    clear_reads()
    model = hf.causal_lm(directory, context=16)
    plan = ExecutionPlan.from_json(plan_json)
    device = dense_rank_map(plan).device_of_rank[rank]
    trainer = PipelineTrainer(model, plan, device, micro_batch_size=2)
    trainer.step(0)
    layers = trainer.layer_ids
    trainer.close()
    return device, layers, sorted(set(tensors_read())), len(tensors_read())


@pytest.mark.timeout(90)
def test_each_device_reads_only_its_layers(tiny_dirs):
    from chameleon_elastic.models import hf

    directory = tiny_dirs("llama-tiny", layers=LAYERS - 2, max_shard_size="30KB")
    assert (directory / "model.safetensors.index.json").is_file()
    names = hf.layers_of(hf.causal_lm(directory))
    results = run_local_world(_train_and_list_reads, 4, str(directory), _plan().to_json(),
                              timeout_s=80)
    everything = set()
    for device, layers, read, count in results:
        mine = {n for i in layers for n in names.names(i)}
        if LAYERS - 1 in layers:   # the tied head's weight is the stored embedding
            mine = (mine - {"lm_head.weight"}) | {"model.embed_tokens.weight"}
        assert set(read) == mine, f"device {device} (layers {layers}) read {read}"
        everything |= set(read)
    assert {layers for _, layers, _, _ in results} == {(0, 1, 2), (3, 4, 5)}
    assert "model.layers.0.self_attn.q_proj.weight" not in results[1][2]   # device 1: 3-5
