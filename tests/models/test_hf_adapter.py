"""causal_lm's layers, run one after another in one process, are the transformers model: same
loss on the same input_ids and labels (fp32, 1e-5), from unsharded and sharded checkpoints and
for random initialisation from a config; and each bad input is one sentence."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from chameleon_elastic.models import hf
from chameleon_elastic.runtime.model import build_layers, collate


def _chain(model, input_ids):
    x = input_ids
    for layer in build_layers(model, 0, model.num_layers):
        x = layer(x)
    return x


def _batch(vocab: int = 288, length: int = 24):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (3, length), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100   # ignored positions, as a padded prompt would have
    return ids, labels


@pytest.mark.parametrize("name, tied", [("llama-tiny", True), ("qwen2-tiny", False),
                                        ("gpt2-tiny", True), ("mistral-tiny", False),
                                        ("qwen3-tiny", False)])
def test_layers_in_one_process_give_transformers_loss(tiny_dirs, name, tied):
    from transformers import AutoModelForCausalLM

    directory = tiny_dirs(name, layers=3)
    reference = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    ids, labels = _batch(length=40)   # longer than mistral-tiny's window of 32
    model = hf.causal_lm(directory)
    assert model.num_layers == 3 + 2
    assert bool(model.tied) == tied
    with torch.no_grad():
        want = reference(input_ids=ids, labels=labels).loss.item()
        got = model.loss(_chain(model, ids), labels).item()
    assert abs(got - want) < 1e-5, (got, want)


def test_sharded_checkpoint_loads_the_same(tiny_dirs):
    from transformers import AutoModelForCausalLM

    directory = tiny_dirs("qwen2-tiny", layers=3, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    reference = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    ids, labels = _batch()
    model = hf.causal_lm(directory)
    with torch.no_grad():
        want = reference(input_ids=ids, labels=labels).loss.item()
        got = model.loss(_chain(model, ids), labels).item()
    assert abs(got - want) < 1e-5


def test_random_init_from_a_config_is_seeded_per_layer_and_ties_start_equal():
    config = hf.tiny_config("llama-tiny", layers=2)
    a, b = hf.causal_lm(config, seed=3), hf.causal_lm(config, seed=3)
    la, lb = build_layers(a, 0, a.num_layers), build_layers(b, 0, b.num_layers)
    for x, y in zip(la, lb):
        for (k, v), w in zip(x.state_dict().items(), y.state_dict().values()):
            assert torch.equal(v, w), k
    embed = la[0].get_parameter("model.embed_tokens.weight")
    head = la[-1].get_parameter("lm_head.weight")
    assert torch.equal(embed, head) and embed.data_ptr() != head.data_ptr()
    # transformers' initialisation: norms start at one, matrices at initializer_range
    assert torch.equal(la[1].get_parameter("model.layers.0.input_layernorm.weight"),
                       torch.ones(32))
    assert abs(embed.std().item() - config.initializer_range) < 0.005
    # the model's default samples are (input_ids, labels) of its context
    ids, labels = collate(a, [0, 1])
    assert ids.shape == labels.shape == (2, 128) and torch.equal(ids, labels)


def test_gpt2_keeps_its_scaled_residual_initialisation():
    config = hf.tiny_config("gpt2-tiny", layers=2)
    block = build_layers(hf.causal_lm(config), 1, 2)[0]
    proj = block.get_parameter("transformer.h.0.attn.c_proj.weight")
    qkv = block.get_parameter("transformer.h.0.attn.c_attn.weight")
    assert proj.std().item() < 0.7 * qkv.std().item()   # 0.02 / sqrt(2 * 2 layers)


def test_tensor_parallel_plan_comes_from_the_config():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = hf.causal_lm(hf.tiny_config("llama-tiny", layers=2))
    plan = model.tp_plan(2)
    assert isinstance(plan["model.layers.1.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.1.mlp.down_proj"], RowwiseParallel)
    assert model.tp_plan(0) is None and model.tp_plan(3) is None
    assert hf.causal_lm(hf.tiny_config("gpt2-tiny")).tp_plan(1) is None   # no plan: whole
    from chameleon_elastic.models.hf_tp import SumGradients

    qwen3 = hf.causal_lm(hf.tiny_config("qwen3-tiny")).tp_plan(1)
    assert isinstance(qwen3["model.layers.0.self_attn.q_norm"], SumGradients)


@pytest.mark.parametrize("name", sorted(hf.TINY))
def test_weight_decay_groups_come_from_transformers_names(name):
    """The optimizer sees transformers' names; hf.adamw leaves exactly the norms' weights
    (found by module type) and the biases undecayed, whichever layers a device holds."""
    from chameleon_elastic.runtime.model import make_optimizer

    model = hf.causal_lm(hf.tiny_config(name, layers=2))
    skeleton = hf.layers_of(model).skeleton
    undecayed = {f"{m}.{n}" for m, module in skeleton.named_modules()
                 if "norm" in type(module).__name__.lower()
                 for n, _ in module.named_parameters(recurse=False)}
    undecayed |= {n for n, _ in skeleton.named_parameters() if n.endswith(".bias")}
    layers = {i: build_layers(model, i, i + 1)[0] for i in (1, model.num_layers - 1)}
    optimizer = make_optimizer(model, layers)
    by_group = {n: g["weight_decay"] for g in optimizer.param_groups for n in g["param_names"]}
    assert set(by_group) == {n for m in layers.values() for n, _ in m.named_parameters()}
    assert {n for n, wd in by_group.items() if wd == 0.0} == set(by_group) & undecayed
    assert any(wd > 0 for wd in by_group.values())


# ------------------------------------------------------------------ bad input, one sentence


def _one_sentence(message: str) -> None:
    assert "\n" not in message.strip() and "Traceback" not in message


def test_directory_without_config_is_one_sentence(tmp_path):
    with pytest.raises(hf.HFModelError) as err:
        hf.causal_lm(tmp_path)
    assert "has no config.json" in str(err.value)
    _one_sentence(str(err.value))


def test_a_model_directory_that_does_not_exist_is_said_so(tmp_path):
    for path, says in ((tmp_path / "nope", "does not exist"),
                       (tmp_path / "file", "is a file, not a directory")):
        if path.name == "file":
            path.write_text("")
        with pytest.raises(hf.HFModelError) as err:
            hf.causal_lm(path)
        assert f"the model directory {str(path)!r} {says}" in str(err.value)
        _one_sentence(str(err.value))


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    from transformers import OPTConfig

    OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
              num_attention_heads=2).save_pretrained(str(tmp_path))
    with pytest.raises(hf.HFModelError) as err:
        hf.causal_lm(tmp_path)
    message = str(err.value)
    assert "'opt'" in message and "gpt2, llama, mistral, qwen2, qwen3" in message
    _one_sentence(message)


def test_pickled_weights_are_refused_not_ignored(tmp_path):
    hf.tiny_config("llama-tiny").save_pretrained(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(hf.HFModelError) as err:
        hf.causal_lm(tmp_path)
    assert "never unpickled" in str(err.value)
    _one_sentence(str(err.value))


def test_missing_extra_says_which_pip_install_fixes_it():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import chameleon_elastic.models, chameleon_elastic.models.hf as hf\n"
            "try:\n    hf.causal_lm('x')\n"
            "except hf.HFModelError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'chameleon-elastic[hf]'" in out.stdout
    _one_sentence(out.stdout)
