"""Job spec: parsing, per-layer figures, presets, and one-sentence errors naming the key."""

from pathlib import Path

import pytest

from chameleon_elastic.spec import (
    JobSpec,
    SpecError,
    cards_of,
    load_job,
    preset_names,
    unit_of,
    units_of,
)

GOOD = """
[model]
layers = 4
forward_s = 0.01
backward_s = [0.02, 0.02, 0.02, 0.05]
param_bytes = 4.0e8
optimizer_bytes = 1.6e9
activation_bytes = 2.0e8
[cluster]
devices = 8
device_memory_bytes = 64e9
bandwidth_bytes_per_s = 25e9
restart_s = 5.0
failure_rate_per_hour = 0.1
[training]
dp = 4
pp = 2
global_micro_batches = 64
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_planner_templates_default_on_and_can_be_turned_off(tmp_path):
    assert JobSpec.from_toml(write(tmp_path, GOOD)).planner.templates is True
    off = JobSpec.from_toml(write(tmp_path, GOOD + "[planner]\ntemplates = false\n"))
    assert off.planner.templates is False
    assert JobSpec.from_dict(off.to_dict()) == off


def test_scalar_and_list_per_layer_figures(tmp_path):
    spec = JobSpec.from_toml(write(tmp_path, GOOD))
    assert spec.model.forward_s == (0.01,) * 4
    assert spec.model.backward_s == (0.02, 0.02, 0.02, 0.05)
    assert spec.training.micro_batch_size == 1
    assert spec.name == "job"
    assert JobSpec.from_dict(spec.to_dict(), spec.name) == spec


@pytest.mark.parametrize(
    "change, words",
    [
        (("layers = 4", "layers = 0"), ["model.layers", "0", "integer >= 1"]),
        (("forward_s = 0.01", "forward_s = -1"), ["model.forward_s", "-1", "> 0"]),
        (("backward_s = [0.02, 0.02, 0.02, 0.05]", "backward_s = [0.02]"),
         ["model.backward_s", "1 entries", "model.layers = 4"]),
        (("backward_s = [0.02, 0.02, 0.02, 0.05]", "backward_s = [0.02, 0.02, 0.02, \"x\"]"),
         ["model.backward_s[3]", "'x'"]),
        (("devices = 8", "devices = 7"), ["exceeds cluster.devices = 7"]),
        (("dp = 4", "dp = 4\nzz = 1"), ["training.zz", "dp, pp"]),
        (("restart_s = 5.0\n", ""), ["missing key cluster.restart_s"]),
        (("dp = 4\npp = 2", "dp = 1\npp = 5"), ["training.pp = 5", "model.layers = 4"]),
        (("global_micro_batches = 64", "global_micro_batches = 3"), ["less than training.dp"]),
        (("device_memory_bytes = 64e9", "device_memory_bytes = 'big'"),
         ["cluster.device_memory_bytes", "'big'", "finite number"]),
        (("global_micro_batches = 64", "global_micro_batches = 64\n[planner]\ntemplates = 1"),
         ["planner.templates", "1", "true or false"]),
        (("restart_s = 5.0", "restart_s = 5.0\nrecovery = 'restart'"),
         ["cluster.recovery", "'restart'", "inplace, relaunch"]),
        (("restart_s = 5.0", "restart_s = 5.0\nrecovery = 1"),
         ["cluster.recovery", "1", "inplace, relaunch"]),
        (("restart_s = 5.0", "restart_s = 5.0\nregroup_s = -0.5"),
         ["cluster.regroup_s", "-0.5", "finite number >= 0"]),
        (("restart_s = 5.0", "restart_s = 5.0\nregroup_s = 'fast'"),
         ["cluster.regroup_s", "'fast'", "finite number >= 0"]),
        (("restart_s = 5.0", "restart_s = 5.0\nregroup_s = inf"),
         ["cluster.regroup_s", "inf", "finite number >= 0"]),
        (("global_micro_batches = 64", "global_micro_batches = 64\nprecision = 'fp8'"),
         ["training.precision", "'fp8'", "fp32, bf16, fp16"]),
        (("layers = 4", "layers = 4\nprecision = 16"),
         ["model.precision", "16", "fp32, bf16, fp16"]),
        (("layers = 4", "layers = 4\nboundary_bytes = [1e6, 1e6]"),
         ["model.boundary_bytes", "2 entries", "model.layers = 4"]),
        (("layers = 4", "layers = 4\nboundary_bytes = -1"),
         ["model.boundary_bytes", "-1", ">= 0"]),
        (("global_micro_batches = 64", "global_micro_batches = 64\n[planner]\nrecompute = 'yes'"),
         ["planner.recompute", "'yes'", "auto, never, always"]),
        (("global_micro_batches = 64", "global_micro_batches = 64\n[planner]\nrecompute = true"),
         ["planner.recompute", "True", "auto, never, always"]),
        (("global_micro_batches = 64", "global_micro_batches = 64\n[stragglers]\nthreshold = 0"),
         ["stragglers.threshold", "0", "> 0 and <= 1"]),
        (("global_micro_batches = 64", "global_micro_batches = 64\n[stragglers]\nwindow = 0"),
         ["stragglers.window", "0", "integer >= 1"]),
        (("global_micro_batches = 64",
          "global_micro_batches = 64\n[stragglers]\nthreshold = 0.8\nrecover = 0.5"),
         ["stragglers.recover = 0.5", "below stragglers.threshold = 0.8", "recover >= threshold"]),
        (("global_micro_batches = 64", "global_micro_batches = 64\n[stragglers]\nwindw = 3"),
         ["windw", "stragglers"]),
    ],
)
def test_bad_values_name_key_value_and_expectation(tmp_path, change, words):
    old, new = change
    assert old in GOOD
    with pytest.raises(SpecError) as info:
        JobSpec.from_toml(write(tmp_path, GOOD.replace(old, new)))
    message = str(info.value)
    for word in words:
        assert word in message
    assert "\n" not in message


def test_missing_section_and_bad_toml(tmp_path):
    with pytest.raises(SpecError, match=r"\[cluster\]"):
        JobSpec.from_toml(write(tmp_path, GOOD.replace("[cluster]", "[clusterx]")))
    with pytest.raises(SpecError, match="not valid TOML"):
        JobSpec.from_toml(write(tmp_path, "[model\n"))
    with pytest.raises(SpecError, match="cannot read job file"):
        JobSpec.from_toml(tmp_path / "absent.toml")


def test_presets_load_and_unknown_preset_lists_choices():
    names = preset_names()
    assert "llama2-7b-910b" in names
    for name in names:
        spec = JobSpec.preset(name)
        assert spec.name == name
        assert spec.training.dp * spec.training.pp <= spec.cluster.devices
    with pytest.raises(SpecError, match="llama2-7b-910b"):
        JobSpec.preset("nope")


def test_load_job_needs_exactly_one_source(tmp_path):
    with pytest.raises(SpecError, match="mutually exclusive"):
        load_job(write(tmp_path, GOOD), "tiny-cpu")
    with pytest.raises(SpecError, match="--job"):
        load_job(None, None)
    assert load_job(None, "tiny-cpu").name == "tiny-cpu"


def test_expected_run_time_is_inverse_of_total_failure_rate():
    spec = JobSpec.preset("llama2-7b-910b")
    assert spec.cluster.expected_run_s(8) == pytest.approx(3600 / (8 * 0.1))


def test_recovery_keys_default_to_inplace_and_decide_the_switch_cost(tmp_path):
    spec = JobSpec.from_toml(write(tmp_path, GOOD))
    assert (spec.cluster.recovery, spec.cluster.regroup_s) == ("inplace", 1.0)
    assert spec.cluster.switch_s == 1.0
    text = GOOD.replace("restart_s = 5.0", "restart_s = 5.0\nrecovery = 'relaunch'\nregroup_s = 0")
    relaunch = JobSpec.from_toml(write(tmp_path, text))
    assert (relaunch.cluster.recovery, relaunch.cluster.regroup_s) == ("relaunch", 0.0)
    assert relaunch.cluster.switch_s == 5.0  # a relaunch restarts the processes
    assert relaunch.with_recovery("inplace").cluster.switch_s == 0.0
    assert relaunch.with_recovery(None) is relaunch
    assert JobSpec.from_dict(relaunch.to_dict()) == relaunch
    with pytest.raises(SpecError, match="cluster.recovery = 'both' is invalid"):
        spec.with_recovery("both")


def test_presets_state_how_they_recover():
    # The paper's system relaunches its processes; the tiny CPU job regroups in place.
    for name in ("llama2-7b-910b", "llama2-7b-910b-32"):
        cluster = JobSpec.preset(name).cluster
        assert cluster.recovery == "relaunch" and cluster.switch_s == cluster.restart_s
    tiny = JobSpec.preset("tiny-cpu").cluster
    assert tiny.recovery == "inplace" and tiny.switch_s == tiny.regroup_s == 0.3


def test_precision_recompute_and_boundary_defaults(tmp_path):
    spec = JobSpec.from_toml(write(tmp_path, GOOD))
    assert (spec.training.precision, spec.model.precision) == ("fp32", "fp32")
    assert spec.planner.recompute == "auto"
    # Absent boundary bytes follow the activations (an upper bound), and stay absent in
    # to_dict, so a measured profile that replaces the activations moves them too.
    assert spec.model.boundary_bytes is None
    assert spec.model.boundary_figures == spec.model.activation_bytes
    assert "boundary_bytes" not in spec.to_dict()["model"]
    data = spec.to_dict()
    data["model"]["activation_bytes"] = 3.0e8
    assert JobSpec.from_dict(data).model.boundary_figures == (3.0e8,) * 4


def test_precision_recompute_and_boundary_round_trip(tmp_path):
    text = (GOOD.replace("layers = 4", "layers = 4\nprecision = 'bf16'\n"
                         "boundary_bytes = [1e6, 2e6, 2e6, 0]")
            .replace("global_micro_batches = 64", "global_micro_batches = 64\nprecision = 'fp16'")
            + "[planner]\nrecompute = 'never'\n")
    spec = JobSpec.from_toml(write(tmp_path, text))
    assert spec.model.precision == "bf16" and spec.training.precision == "fp16"
    assert spec.model.boundary_bytes == spec.model.boundary_figures == (1e6, 2e6, 2e6, 0.0)
    assert spec.planner.recompute == "never"
    assert JobSpec.from_dict(spec.to_dict(), spec.name) == spec
    assert hash(spec.model) == hash(JobSpec.from_dict(spec.to_dict()).model)  # an lru_cache key
    scalar = JobSpec.from_toml(write(tmp_path, GOOD.replace("layers = 4",
                                                            "layers = 4\nboundary_bytes = 5")))
    assert scalar.model.boundary_bytes == (5.0,) * 4


# --------------------------------------------------------------------------- tensor parallelism


def test_tensor_parallel_keys_default_to_one_card_per_unit(tmp_path):
    spec = JobSpec.from_toml(write(tmp_path, GOOD))
    assert (spec.training.tp, spec.training.tp_efficiency) == (1, 1.0)
    # An absent intra-unit link is the cluster's link, resolved at use and absent in to_dict.
    assert spec.cluster.tp_bandwidth_bytes_per_s is None
    assert spec.cluster.tp_bandwidth == spec.cluster.bandwidth_bytes_per_s
    assert "tp_bandwidth_bytes_per_s" not in spec.to_dict()["cluster"]
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_tensor_parallel_keys_round_trip(tmp_path):
    text = (GOOD.replace("devices = 8", "devices = 16")
            .replace("restart_s = 5.0", "restart_s = 5.0\ntp_bandwidth_bytes_per_s = 5.6e10")
            .replace("dp = 4", "dp = 4\ntp = 2\ntp_efficiency = 0.8"))
    spec = JobSpec.from_toml(write(tmp_path, text))
    assert (spec.training.tp, spec.training.tp_efficiency) == (2, 0.8)
    assert spec.cluster.tp_bandwidth == 5.6e10
    assert spec.cluster.devices == 16  # cards, not units
    assert JobSpec.from_dict(spec.to_dict(), spec.name) == spec


@pytest.mark.parametrize(
    "change, words",
    [
        (("dp = 4", "dp = 4\ntp = 0"), ["training.tp", "0", "integer >= 1"]),
        (("dp = 4", "dp = 4\ntp = 1.5"), ["training.tp", "1.5", "integer >= 1"]),
        (("dp = 4", "dp = 4\ntp = 3"),
         ["cluster.devices = 8", "not a multiple of training.tp = 3", "multiple of 3"]),
        (("dp = 4", "dp = 4\ntp = 2"),
         ["4 x 2 x 2 = 16", "exceeds cluster.devices = 8", "lower dp, pp or tp"]),
        (("dp = 4", "dp = 4\ntp_efficiency = 0"), ["training.tp_efficiency", "0", "> 0 and <= 1"]),
        (("dp = 4", "dp = 4\ntp_efficiency = 1.2"), ["training.tp_efficiency", "1.2", "<= 1"]),
        (("dp = 4", "dp = 4\ntp_efficiency = 'high'"), ["training.tp_efficiency", "'high'"]),
        (("restart_s = 5.0", "restart_s = 5.0\ntp_bandwidth_bytes_per_s = 0"),
         ["cluster.tp_bandwidth_bytes_per_s", "0", "finite number > 0"]),
    ],
)
def test_tensor_parallel_errors_are_one_sentence(tmp_path, change, words):
    old, new = change
    with pytest.raises(SpecError) as info:
        JobSpec.from_toml(write(tmp_path, GOOD.replace(old, new)))
    message = str(info.value)
    for word in words:
        assert word in message
    assert "\n" not in message and message.endswith(".")


def test_cards_and_units():
    assert [unit_of(c, 8) for c in (0, 7, 8, 31)] == [0, 0, 1, 3]
    assert list(cards_of(2, 8)) == list(range(16, 24))
    assert all(unit_of(c, 4) == u for u in range(5) for c in cards_of(u, 4))
    assert units_of([9, 0, 3, 15], 8) == (0, 1)
    assert units_of([5, 2], 1) == (2, 5)  # tp = 1: a unit is a card


def test_straggler_settings_default_and_round_trip(tmp_path):
    spec = JobSpec.from_toml(write(tmp_path, GOOD))
    assert (spec.stragglers.threshold, spec.stragglers.recover, spec.stragglers.window) == (
        0.7, 0.9, 5)
    tuned = JobSpec.from_toml(write(tmp_path, GOOD + "[stragglers]\nthreshold = 0.95\nwindow = 3\n"))
    assert (tuned.stragglers.threshold, tuned.stragglers.recover, tuned.stragglers.window) == (
        0.95, 0.95, 3)   # recover follows a threshold above its default
    assert JobSpec.from_dict(tuned.to_dict()) == tuned
