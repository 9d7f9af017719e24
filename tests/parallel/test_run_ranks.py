"""The test helper run_ranks (tests/helpers/dist.py) forms its own gloo group again, once, when a rank
could not join it, and says so; a second failure, or any failure once fn runs, is the test's error."""

from __future__ import annotations

import queue

import pytest

from tests.helpers import dist as helper


class _Exited:
    exitcode = None


def test_a_rank_whose_group_did_not_form_is_told_apart_from_a_failing_test():
    results: queue.Queue = queue.Queue()
    results.put((1, None, "Traceback ...\nRuntimeError: Gloo connectFullMesh failed"))
    with pytest.raises(helper._GroupNotFormed, match="(?s)--- rank 1 ---\nTraceback .*connectFullMesh"):
        helper._collect([_Exited(), _Exited()], results, timeout=5)


def test_the_group_is_formed_again_once_and_the_retry_is_said(monkeypatch, capsys):
    calls = []

    def run_once(fn, world_size, args, kwargs, timeout):
        calls.append((fn, world_size, args, kwargs, timeout))
        if len(calls) == 1:
            raise helper._GroupNotFormed("\n--- rank 0 ---\nconnection closed")
        return ["r0", "r1"]

    monkeypatch.setattr(helper, "_run_once", run_once)
    assert helper.run_ranks(print, 2, "a", timeout=7, k=1) == ["r0", "r1"]
    assert calls == [(print, 2, ("a",), {"k": 1}, 7)] * 2
    assert "the ranks' gloo group did not form; starting them again:\n--- rank 0 ---\nconnection closed" in (
        capsys.readouterr().err
    )


def test_a_second_failure_to_form_the_group_is_an_error(monkeypatch):
    def run_once(*_):
        raise helper._GroupNotFormed("\n--- rank 1 ---\nconnection closed")

    monkeypatch.setattr(helper, "_run_once", run_once)
    with pytest.raises(RuntimeError, match="could not form their gloo group twice in a row:\n--- rank 1 ---"):
        helper.run_ranks(print, 2)


def test_an_error_once_fn_runs_is_not_retried(monkeypatch):
    calls = []

    def run_once(*_):
        calls.append(1)
        raise ValueError("the test's own failure")

    monkeypatch.setattr(helper, "_run_once", run_once)
    with pytest.raises(ValueError, match="the test's own failure"):
        helper.run_ranks(print, 2)
    assert calls == [1]
