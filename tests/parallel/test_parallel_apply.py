"""parallel_apply: threads, propagated state, errors; attach_replica_graphs: parallel backward."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from ember.parallel.parallel_apply import attach_replica_graphs, parallel_apply

CPU = torch.device("cpu")


def snapshot(*_args, **_kwargs):
    return {
        "thread": threading.current_thread().name,
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "dtype": torch.get_autocast_dtype("cpu"),
        "threads": torch.get_num_threads(),
        "args": _args,
        "kwargs": _kwargs,
    }


def test_results_in_order_one_thread_per_replica():
    out = parallel_apply([lambda x: x * 10 for _ in range(3)], [(1,), (2,), (3,)])
    assert out == [10, 20, 30]
    names = [s["thread"] for s in parallel_apply([snapshot] * 3, [()] * 3)]
    assert len(set(names)) == 3 and threading.current_thread().name not in names


def test_single_replica_runs_inline():
    [got] = parallel_apply([snapshot], [()])
    assert got["thread"] == threading.current_thread().name


def test_inputs_kwargs_and_method():
    class Replica(nn.Module):
        def training_step(self, batch, batch_idx, scale=1):
            return batch * scale + batch_idx

    out = parallel_apply(
        [Replica(), Replica()], [(1, 0), [5, 1]], [{"scale": 2}, {}], devices=["cpu", "cpu"], method="training_step"
    )
    assert out == [2, 6]
    got = parallel_apply([snapshot, snapshot], [torch.ones(1), (1, 2)])
    assert len(got[0]["args"]) == 1 and got[1]["args"] == (1, 2)  # a non-tuple is one argument


def test_grad_and_inference_mode_are_propagated():
    with torch.no_grad():
        assert not any(s["grad"] for s in parallel_apply([snapshot] * 2, [()] * 2))
    assert all(s["grad"] for s in parallel_apply([snapshot] * 2, [()] * 2))
    with torch.inference_mode():
        assert all(s["inference"] for s in parallel_apply([snapshot] * 2, [()] * 2))


def test_autocast_enabled_and_dtype_are_propagated():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = parallel_apply([snapshot] * 2, [()] * 2)
    assert all(s["autocast"] and s["dtype"] == torch.bfloat16 for s in got)
    assert not any(s["autocast"] for s in parallel_apply([snapshot] * 2, [()] * 2))

    def matmul_dtype():
        return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert parallel_apply([matmul_dtype] * 2, [()] * 2) == [torch.bfloat16] * 2


def test_threads_per_replica_and_callers_setting_restored():
    before = torch.get_num_threads()
    got = parallel_apply([snapshot] * 2, [()] * 2, threads_per_replica=1)
    assert [s["threads"] for s in got] == [1, 1]
    assert torch.get_num_threads() == before


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one entry per replica: got 2 modules, 1 inputs"):
        parallel_apply([snapshot, snapshot], [()])


def boom_in_replica():
    raise KeyError("missing-key")


def test_exception_names_replica_and_device_with_traceback():
    threads_before = threading.active_count()

    def ok() -> int:
        return 1

    with pytest.raises(KeyError) as info:
        parallel_apply([ok, boom_in_replica], [(), ()], devices=["cpu", "cpu"])
    text = str(info.value)
    assert "in replica 1 on device cpu" in text
    assert "boom_in_replica" in text and "missing-key" in text  # the original traceback
    assert info.value.replica == 1
    assert threading.active_count() == threads_before


def test_exception_type_that_needs_more_arguments_becomes_runtime_error():
    class Picky(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    def fail():
        raise Picky(1, 2)

    with pytest.raises(RuntimeError, match="Caught Picky in replica 0"):
        parallel_apply([fail, fail], [(), ()])


def test_all_failures_reported_and_threads_joined():
    def fail(i):
        raise ValueError(f"bad {i}")

    with pytest.raises(ValueError, match=r"replica 0 .*\(replicas \[1, 2\] failed too\)"):
        parallel_apply([fail] * 3, [(0,), (1,), (2,)])
    assert not [t for t in threading.enumerate() if t.name.startswith("ember-replica")]


def test_single_replica_exception_is_wrapped_too():
    with pytest.raises(KeyError, match="replica 0"):
        parallel_apply([boom_in_replica], [()])


# --- attach_replica_graphs ----------------------------------------------------------------------
def _replica_graphs(weight: torch.Tensor, chunks: list[torch.Tensor], shared: bool = True):
    """Two replicas using one leaf each for ``weight`` (shared or per replica)."""
    leaf = weight.detach().requires_grad_()
    leaves = [[leaf], [leaf if shared else weight.detach().requires_grad_()]]
    outputs = [(c @ row[0]).tanh() for c, row in zip(chunks, leaves)]
    return outputs, leaves


@pytest.mark.parametrize("shared", [True, False])
def test_parallel_backward_gradients_match_one_graph(shared):
    w = torch.randn(3, 2, requires_grad=True)
    x = torch.randn(5, 3)
    (x @ w).tanh().pow(2).sum().backward()
    expected, w.grad = w.grad.clone(), None

    outputs, leaves = _replica_graphs(w, [x[:3], x[3:]], shared)
    joined = attach_replica_graphs(outputs, [w], leaves, [CPU, CPU])
    torch.cat(joined).pow(2).sum().backward()
    torch.testing.assert_close(w.grad, expected)


def test_parallel_backward_runs_replicas_on_their_own_threads():
    w = torch.randn(3, 2, requires_grad=True)
    seen = []
    outputs, leaves = _replica_graphs(w, [torch.randn(2, 3), torch.randn(2, 3)])
    for o in outputs:
        o.register_hook(lambda g: seen.append(threading.current_thread().name))
    joined = attach_replica_graphs(outputs, [w], leaves, [CPU, CPU])
    torch.cat(joined).sum().backward()
    assert len(set(seen)) == 2 and threading.current_thread().name not in seen


def test_retain_graph_allows_a_second_backward_and_frees_otherwise():
    w = torch.randn(3, 2, requires_grad=True)
    outputs, leaves = _replica_graphs(w, [torch.randn(2, 3), torch.randn(2, 3)])
    loss = torch.cat(attach_replica_graphs(outputs, [w], leaves, [CPU, CPU])).sum()
    loss.backward(retain_graph=True)
    once = w.grad.clone()
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * once)
    with pytest.raises(RuntimeError, match="backward through the data-parallel replicas a second"):
        loss.backward()


def test_create_graph_is_refused_clearly():
    w = torch.randn(3, 2, requires_grad=True)
    outputs, leaves = _replica_graphs(w, [torch.randn(2, 3), torch.randn(2, 3)])
    loss = torch.cat(attach_replica_graphs(outputs, [w], leaves, [CPU, CPU])).sum()
    with pytest.raises(RuntimeError, match="create_graph=True.*parallel_backward=False"):
        torch.autograd.grad(loss, w, create_graph=True)


def test_autograd_grad_leaves_dot_grad_alone():
    w = torch.randn(3, 2, requires_grad=True)
    outputs, leaves = _replica_graphs(w, [torch.randn(2, 3), torch.randn(2, 3)])
    loss = torch.cat(attach_replica_graphs(outputs, [w], leaves, [CPU, CPU])).sum()
    (g,) = torch.autograd.grad(loss, w)
    assert g.shape == w.shape and w.grad is None
    assert all(row[0].grad is None for row in leaves)


def test_error_in_a_replicas_backward_names_it():
    w = torch.randn(3, 2, requires_grad=True)
    outputs, leaves = _replica_graphs(w, [torch.randn(2, 3), torch.randn(2, 3)], shared=False)

    def fail(grad):
        raise OverflowError("bad gradient")

    outputs[1].register_hook(fail)
    loss = torch.cat(attach_replica_graphs(outputs, [w], leaves, [CPU, CPU])).sum()
    with pytest.raises(OverflowError, match="(?s)replica 1 on device cpu.*bad gradient"):
        loss.backward()


def test_outputs_without_grad_are_returned_unchanged():
    outs = [torch.ones(2), {"n": 3}]
    assert attach_replica_graphs(outs, [], [[], []], [CPU, CPU]) is outs


def test_foreign_tensor_requiring_grad_is_detected():
    w = torch.randn(3, 2, requires_grad=True)
    stray = torch.randn(2, requires_grad=True)
    outputs, leaves = _replica_graphs(w, [torch.randn(2, 3), torch.randn(2, 3)])
    outputs = [o + stray for o in outputs]
    with pytest.raises(RuntimeError, match="neither a parameter or buffer"):
        attach_replica_graphs(outputs, [w], leaves, [CPU, CPU], check_leaves=True)


def test_parallel_backward_is_refused_on_cuda_devices():
    # On CUDA the joint node's backward would join threads whose GPU work waits for the very
    # autograd thread it runs on: a deadlock. Refused before anything touches a GPU.
    x = torch.ones(2, requires_grad=True)
    leaf = x.detach().requires_grad_(True)
    with pytest.raises(ValueError, match=r"CPU replicas only; on cuda:0, cuda:1 it would deadlock"):
        attach_replica_graphs([leaf * 2, leaf * 3], [x], [[leaf], [leaf]], ["cuda:0", "cuda:1"])


def test_the_torch_floor_has_the_per_device_autocast_queries():
    # _CallerState reads torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype,
    # which torch 2.4 introduced: the package must not allow an older torch.
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    major, minor = map(int, re.search(r'"torch>=(\d+)\.(\d+)', text).groups())
    assert (major, minor) >= (2, 4)
