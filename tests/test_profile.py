"""Measured profiles: the one format, its round-trip, apply(spec), the one-sentence refusals,
and the in-process producer (runtime.profiler.profile_layers) on a real tiny model."""

from __future__ import annotations

import ast
import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import chameleon_elastic.profile as profile_module
from chameleon_elastic.models.toy import mlp_model
from chameleon_elastic.profile import (
    PROFILE_KIND,
    ClusterFigures,
    DeviceFigures,
    MeasuredProfile,
    ModelFigures,
    ProfileError,
)
from chameleon_elastic.runtime.profiler import main as profiler_main
from chameleon_elastic.runtime.profiler import profile_layers
from chameleon_elastic.spec import JobSpec, ModelProfile, SpecError


def _spec(layers: int = 4, **training) -> JobSpec:
    return JobSpec.from_dict({
        "name": "small",
        "model": {"layers": layers, "forward_s": 0.01, "backward_s": 0.02,
                  "param_bytes": 1e6, "optimizer_bytes": 2e6, "activation_bytes": 4e5,
                  "boundary_bytes": 1e5},
        "cluster": {"devices": 4, "device_memory_bytes": 1e9, "bandwidth_bytes_per_s": 1e9,
                    "restart_s": 2.0, "failure_rate_per_hour": 0.1, "regroup_s": 0.5},
        "training": {"dp": 2, "pp": 2, "global_micro_batches": 8, **training},
    })


FULL = MeasuredProfile(
    how="layers", precision="bf16", micro_batch_size=2, job="small", measured_on="cpu",
    model=ModelFigures(layers=4, forward_s=(0.1, 0.2, 0.2, 0.3), backward_s=0.4,
                       param_bytes=(1.0, 2.0, 3.0, 4.0), optimizer_bytes=8.0,
                       activation_bytes=(5.0, 6.0, 7.0, 8.0), boundary_bytes=2.0),
    cluster=ClusterFigures(regroup_s=0.25),
    devices={0: DeviceFigures(rss_peak_bytes=100, step_time_s=0.5),
             3: DeviceFigures(device_memory_peak_bytes=7)},
)


def test_json_round_trip_and_atomic_write(tmp_path):
    assert MeasuredProfile.from_json(FULL.to_json()) == FULL
    path = FULL.write(tmp_path / "sub" / "p.json")
    assert MeasuredProfile.load(path) == FULL
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]    # no temp file left
    data = json.loads(path.read_text())
    assert (data["kind"], data["version"], data["how"]) == (PROFILE_KIND, 1, "layers")
    assert data["model"]["boundary_bytes"] == 2.0 and data["devices"]["3"]["rss_peak_bytes"] is None
    empty = MeasuredProfile(how="steps")
    assert MeasuredProfile.from_json(empty.to_json()) == empty


def test_model_figures_are_job_spec_keys():
    """One vocabulary: every measured [model] figure is a key the spec takes."""
    spec_keys = {f.name for f in fields(ModelProfile)}
    assert {f.name for f in fields(ModelFigures)} <= spec_keys


def test_format_module_does_not_import_torch():
    tree = ast.parse(Path(profile_module.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "torch" for name in imported)


def test_apply_replaces_guesses_with_measured_figures():
    spec = _spec(micro_batch_size=2, precision="bf16")
    tuned = FULL.apply(spec)
    assert tuned.model.forward_s == (0.1, 0.2, 0.2, 0.3)
    assert tuned.model.backward_s == (0.4,) * 4
    assert tuned.model.param_bytes == (1.0, 2.0, 3.0, 4.0)
    assert tuned.model.activation_bytes == (5.0, 6.0, 7.0, 8.0)
    assert tuned.model.boundary_bytes == (2.0,) * 4
    assert tuned.model.precision == "bf16"
    assert tuned.cluster.regroup_s == 0.25
    assert (tuned.name, tuned.training, tuned.planner) == (spec.name, spec.training, spec.planner)
    only_regroup = MeasuredProfile(how="steps", cluster=ClusterFigures(regroup_s=0.1))
    assert only_regroup.apply(spec).model == spec.model


def test_apply_converts_the_unmeasured_byte_guess_to_the_measured_precision():
    spec = _spec()                                   # fp32 guesses, boundary 1e5
    half = MeasuredProfile(how="layers", precision="bf16",
                           model=ModelFigures(activation_bytes=3e5))
    tuned = half.apply(spec)
    assert tuned.model.precision == "bf16"
    assert tuned.model.activation_bytes == (3e5,) * 4
    assert tuned.model.boundary_bytes == (5e4,) * 4   # the fp32 guess at bf16's element size


@pytest.mark.parametrize("profile,needle", [
    (MeasuredProfile(how="layers", model=ModelFigures(layers=5)), "covers 5 layers"),
    (MeasuredProfile(how="layers", micro_batch_size=3), "micro-batches of 3 samples"),
    (MeasuredProfile(how="layers", precision="fp16", model=ModelFigures(forward_s=0.1)),
     "timed the layers at fp16"),
    (MeasuredProfile(how="steps", model=ModelFigures(forward_s=(0.1, 0.0, 0.1, 0.1))),
     "model.forward_s[1] = 0.0 is invalid"),                       # the spec's own sentence
    (MeasuredProfile(how="steps", model=ModelFigures(backward_s=(0.1, 0.2))),
     "model.backward_s has 2 entries"),
])
def test_apply_refuses_a_profile_of_another_job_in_one_sentence(profile, needle):
    with pytest.raises(SpecError) as info:
        profile.apply(_spec())
    message = str(info.value)
    assert needle in message and "\n" not in message and message.endswith(".")


@pytest.mark.parametrize("text,needle", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "is not a measured profile"),
    ('{"kind": "something-else", "version": 1}', "is not a measured profile"),
    # the format chameleon-run wrote before profiles had a version
    ('{"kind": "chameleon-measured-profile", "model": {}, "cluster": {}}', "format version None"),
    ('{"kind": "chameleon-measured-profile", "version": 2, "how": "layers"}', "format version 2"),
    ('{"kind": "chameleon-measured-profile", "version": 1, "how": "guessed"}', "how = 'guessed'"),
    (('{"kind": "chameleon-measured-profile", "version": 1, "how": "layers", '
      '"precision": "fp8"}'), "precision = 'fp8'"),
    (('{"kind": "chameleon-measured-profile", "version": 1, "how": "layers", '
      '"model": {"forward_s": "fast"}}'), "model.forward_s = 'fast'"),
    (('{"kind": "chameleon-measured-profile", "version": 1, "how": "layers", '
      '"model": {"flops": 3}}'), "unknown key model.flops"),
    (('{"kind": "chameleon-measured-profile", "version": 1, "how": "steps", '
      '"devices": {"zero": {}}}'), "devices['zero']"),
])
def test_a_file_that_is_not_a_usable_profile_is_one_sentence_naming_it(tmp_path, text, needle):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        MeasuredProfile.load(path)
    message = str(info.value)
    assert needle in message, message
    assert str(path) in message and "\n" not in message and message.endswith(".")


def test_a_missing_file_is_one_sentence(tmp_path):
    with pytest.raises(ProfileError, match=r"cannot read measured profile .*missing\.json"):
        MeasuredProfile.load(tmp_path / "missing.json")


# ------------------------------------------------------------------ the in-process producer


def test_profile_layers_measures_a_real_model():
    width, mbs = 8, 2
    measured = profile_layers(mlp_model(layers=3, width=width, dtype=torch.float32),
                              micro_batch_size=mbs, repeats=1, warmup=0)
    assert (measured.how, measured.precision, measured.micro_batch_size) == ("layers", "fp32", 2)
    m = measured.model
    assert m.layers == 3
    for key in ("forward_s", "backward_s", "param_bytes", "optimizer_bytes",
                "activation_bytes", "boundary_bytes"):
        values = getattr(m, key)
        assert isinstance(values, tuple) and len(values) == 3 and min(values) > 0, key
    assert m.param_bytes == ((width * width + width) * 4.0,) * 3   # Linear(8, 8) in fp32
    assert m.optimizer_bytes == m.param_bytes                      # SGD momentum buffers
    assert m.boundary_bytes == (mbs * width * 4.0,) * 3             # the output
    # Linear keeps its input, tanh its output; the weight is a parameter, not an activation
    assert m.activation_bytes == (2 * mbs * width * 4.0,) * 3
    assert all(a >= b for a, b in zip(m.activation_bytes, m.boundary_bytes))
    spec = measured.apply(_spec(layers=3, micro_batch_size=mbs))
    assert spec.model.boundary_bytes == m.boundary_bytes and spec.model.forward_s == m.forward_s


def test_profile_layers_under_autocast_counts_low_precision_tensors():
    width, mbs = 8, 2
    measured = profile_layers(mlp_model(layers=2, width=width, dtype=torch.float32),
                              micro_batch_size=mbs, repeats=1, warmup=0, precision="bf16")
    assert measured.precision == "bf16"
    assert measured.model.boundary_bytes == (mbs * width * 2.0,) * 2        # bf16 output
    assert measured.model.param_bytes == ((width * width + width) * 4.0,) * 2   # fp32 master
    acts = measured.model.activation_bytes
    assert isinstance(acts, tuple) and all(a >= mbs * width * 2.0 * 2 for a in acts)
    with pytest.raises(SpecError, match="timed the layers at bf16"):
        measured.apply(_spec(layers=2, micro_batch_size=mbs))
    assert measured.apply(_spec(layers=2, micro_batch_size=mbs, precision="bf16")
                          ).model.precision == "bf16"


def test_profiler_command_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert profiler_main(["chameleon_elastic.models.toy:mlp_model", "--out", str(out),
                          "--repeats", "1", "--warmup", "0"]) == 0
    assert MeasuredProfile.load(out).model.layers == 7
    assert "chameleon-run --profile" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        profiler_main(["chameleon_elastic.models.toy:nothing_here", "--out", str(out)])
    assert info.value.code == 2
    assert "has no callable 'nothing_here'" in capsys.readouterr().err
