"""The one timeout table: resolution order and the hierarchy it guarantees."""

from __future__ import annotations

import pytest

from chameleon_elastic.timeouts import Timeouts, TimeoutSettingError


def test_environment_over_argument_over_default():
    assert Timeouts.resolve(env={}).collective_s == 120
    assert Timeouts.resolve(env={}, collective_s=7).collective_s == 7
    env = {"CHAMELEON_COLLECTIVE_TIMEOUT_S": "3.5"}
    assert Timeouts.resolve(env=env, collective_s=7).collective_s == 3.5
    assert Timeouts.resolve(env={}, shutdown_s=None).shutdown_s == 30
    assert Timeouts.resolve(env={}).delta("store_s").total_seconds() == 60


@pytest.mark.parametrize("env, needle", [
    ({"CHAMELEON_COLLECTIVE_TIMEOUT_S": "soon"}, "not a number"),
    ({"CHAMELEON_STORE_TIMEOUT_S": "-1"}, "positive"),
    ({"CHAMELEON_COLLECTIVE_TIMEOUT_S": "900"}, "exceeds generation_s"),
    ({"CHAMELEON_GENERATION_TIMEOUT_S": "10"}, "exceeds generation_s"),
])
def test_bad_settings_are_one_sentence_naming_the_variable(env, needle):
    with pytest.raises(TimeoutSettingError, match=needle) as err:
        Timeouts.resolve(env=env)
    assert "\n" not in str(err.value)


def test_the_hang_timeout_follows_a_lowered_collective_timeout_and_stays_below_it():
    assert Timeouts.resolve(env={}).hang_s == 60
    assert Timeouts.resolve(env={"CHAMELEON_COLLECTIVE_TIMEOUT_S": "30"}).hang_s == 15
    assert Timeouts.resolve(env={}, hang_s=0).hang_s == 0          # off
    assert Timeouts.resolve(env={"CHAMELEON_HANG_TIMEOUT_S": "5"}, hang_s=9).hang_s == 5
    with pytest.raises(TimeoutSettingError, match="below the collective timeout"):
        Timeouts.resolve(env={}, hang_s=120)


def test_unknown_names_are_a_programming_error():
    with pytest.raises(TypeError):
        Timeouts.resolve(env={}, heartbeat_s=3)
