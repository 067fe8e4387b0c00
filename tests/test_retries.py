"""Bounded recovery: the cap's resolution and the streak that ends a job whose generations keep
failing, and how a failure is told to be a lost peer (by its type where torch gives one)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from chameleon_elastic.retries import (
    DEFAULT_CAP,
    ENV_VAR,
    FailureStreak,
    RetrySettingError,
    resolve_cap,
)
from chameleon_elastic.runtime.errors import communication_failure


def test_the_cap_resolves_environment_over_flag_over_default():
    assert resolve_cap(env={}) == DEFAULT_CAP
    assert resolve_cap(env={}, given=2) == 2
    assert resolve_cap(env={ENV_VAR: "7"}, given=2) == 7
    assert resolve_cap(env={ENV_VAR: "0"}) == 0   # no cap


@pytest.mark.parametrize("raw", ["-1", "many", "2.5"])
def test_a_bad_cap_is_one_sentence_naming_the_setting(raw):
    with pytest.raises(RetrySettingError, match=ENV_VAR) as err:
        resolve_cap(env={ENV_VAR: raw})
    assert "\n" not in str(err.value)


def test_a_streak_ends_past_the_cap_and_a_committed_step_resets_it():
    streak = FailureStreak(cap=2)
    assert not streak.failed("x") and not streak.failed("x")
    streak.progressed()
    assert not streak.failed("x") and not streak.failed("x")
    assert streak.failed("x") and streak.count == 3


def test_no_cap_never_ends():
    streak = FailureStreak(cap=0)
    assert not any(streak.failed("x") for _ in range(100))


def test_the_sentence_names_the_cause_that_came_back_whatever_its_numbers():
    streak = FailureStreak(cap=3)
    for port in (5001, 5002, 5003):
        streak.failed(f"device 0 failed receiving from device 1: Connection closed by peer "
                      f"[127.0.0.1]:{port}\nsecond line")
    streak.failed("device 2 could not join generation 9")
    said = streak.sentence()
    assert "4 plan generations in a row" in said and "3 of them" in said
    assert "[127.0.0.1]:5003" in said and "second line" not in said
    assert "--max-failed-generations (now 3)" in said and "\n" not in said


def test_typed_errors_are_lost_peers_and_a_scripts_timed_out_is_not():
    assert communication_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert communication_failure(dist.DistNetworkError("connection refused"))
    assert communication_failure(dist.DistStoreError("wait timed out"))
    # gloo gives no type: its own words
    assert communication_failure(RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert communication_failure(RuntimeError("Application timeout caused pair closure"))
    # a script's own errors are bugs, whatever they say
    assert not communication_failure(RuntimeError("the data server timed out"))
    assert not communication_failure(RuntimeError("NCCL error in my custom kernel"))
    assert not communication_failure(ValueError("Connection closed by peer"))
