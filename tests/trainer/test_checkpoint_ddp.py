"""Exact resume under ``ddp`` on 2 real gloo ranks, and across world sizes (2 -> 1, 1 -> 2).

One spawn of 2 ranks (``run_ranks``) runs the reference fit, a fit interrupted by a callback
raising and its resume, and a resume of a single-process checkpoint. DataLoader workers cannot
start inside those (daemonic) ranks, so the other runs are real ``python`` programs launched
with ``strategy="ddp"`` (ember re-runs the script for rank 1): rank 1 SIGKILLed with 0 and with 2
workers, a callback raising with 2 workers, and each one's resume. Every sample is
identified by its index, so the tests can check which samples each epoch trained on.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import signal
import sys
import warnings

import pytest
import torch

pytest.importorskip("ember.strategies.ddp")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ember.checkpoint import load as load_checkpoint  # noqa: E402
from tests.helpers.dist import join_as_rank, run_ranks  # noqa: E402
from tests.helpers.jobs import run_job  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import test_checkpoint_resume as R  # noqa: E402

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]
WORLD = 2
STEPS_PER_EPOCH = R.N // (R.BATCH * WORLD)  # 6
STOP = 11  # checkpoints every 4 steps: resumes from step 8 = epoch 1, batch 2 (16 samples of its order consumed)


def _join(rank: int, world: int) -> None:
    warnings.simplefilter("ignore")
    join_as_rank(rank, world)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def suite(rank: int, world: int, root: str, single_ckpt: str) -> dict:
    _join(rank, world)
    out: dict = {}
    ref, trainer = R.fit(os.path.join(root, "ref"), strategy="ddp", devices=world)
    out["ref"], out["ref_steps"] = _weights(ref), trainer.global_step
    run = os.path.join(root, "raise")
    try:
        R.fit(run, 0, [R.StopAt(STOP)], strategy="ddp", devices=world)
    except RuntimeError:
        pass
    if rank == 0:  # keep the 2-rank checkpoint for the 2 -> 1 test
        shutil.copy(os.path.join(run, "ckpts", "last.ckpt"), os.path.join(root, "from_2_ranks.ckpt"))
    resumed, trainer = R.fit(run, 0, ckpt_path="last", strategy="ddp", devices=world)
    out["resumed"] = _weights(resumed)
    resumed, _ = R.fit(os.path.join(root, "from_single"), ckpt_path=single_ckpt, strategy="ddp", devices=world)
    out["from_single_seen"] = resumed.seen
    return out


def program(mode: str, root: str, out: str, workers: str = "2", strategy: str = "ddp") -> None:
    """One ``python`` run of 2 ranks with ``workers`` DataLoader workers each (see the module doc)."""
    warnings.simplefilter("ignore")
    rank = int(os.environ.get("RANK", "0"))
    if mode == "kill":  # rank 1 dies at step 13, after the checkpoint of step 12
        stop = [R.StopAt(13, (lambda: os.kill(os.getpid(), signal.SIGKILL)) if rank == 1 else (lambda: None))]
        R.fit(root, int(workers), stop, strategy=strategy, devices=WORLD)
    elif mode == "raise":  # both ranks raise at step 13, after the checkpoint of step 12
        R.fit(root, int(workers), [R.StopAt(13)], strategy=strategy, devices=WORLD)
    else:  # "resume": from last.ckpt if there is one, else from the start
        module, trainer = R.fit(root, int(workers), ckpt_path="last", strategy=strategy, devices=WORLD)
        weights = {k: v.detach().cpu().clone() for k, v in trainer.strategy.whole_state_dict().items()}  # every rank
        if rank == 0:
            torch.save({"weights": weights, "ckpt": trainer.ckpt_path, "steps": trainer.global_step}, out)


def run_program(mode: str, root: str, out: str, workers: int = 2, strategy: str = "ddp") -> tuple[int, str]:
    # kill_the_rest: a SIGKILLed rank's loader workers, orphaned.
    command = [sys.executable, os.path.abspath(__file__), mode, root, out, str(workers), strategy]
    code, output = run_job(command, 60, True)
    return code, output[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("ddp"))
    single = os.path.join(root, "single")
    with pytest.raises(RuntimeError):
        R.fit(single, callbacks=[R.StopAt(17)])  # resumes from step 16 = epoch 1, batch 4: 16 samples consumed
    single_ckpt = os.path.join(root, "from_single.ckpt")
    shutil.copy(os.path.join(single, "ckpts", "last.ckpt"), single_ckpt)
    ranks = run_ranks(suite, WORLD, root, single_ckpt, timeout=110)
    return {"root": root, "ranks": ranks, "single_ckpt": single_ckpt}


def assert_equal_weights(a: dict, b: dict) -> None:
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"weights differ: {diff}"


def epoch_order(ckpt_path: str) -> list[int]:
    ckpt = torch.load(ckpt_path, weights_only=True)
    g = torch.Generator()
    g.manual_seed(ckpt["sampler"]["seed"])
    return torch.randperm(R.N, generator=g).tolist()


def test_ddp_resume_after_callback_raises_is_bitwise(runs):
    ranks = runs["ranks"]
    assert ranks[0]["ref_steps"] == R.EPOCHS * STEPS_PER_EPOCH
    for r in ranks:
        assert_equal_weights(r["resumed"], ranks[0]["ref"])
        assert_equal_weights(r["ref"], ranks[0]["ref"])


@pytest.mark.parametrize("mode, workers", [("kill", 2), ("kill", 0), ("raise", 2)])
def test_ddp_program_resumes_bitwise_after_interruption(runs, tmp_path, mode, workers):
    # kill: rank 1 is SIGKILLed; raise: a callback raises on both ranks. (raise with 0 workers: the suite above.)
    root, out = str(tmp_path / "run"), str(tmp_path / "result.pt")
    last = os.path.join(root, "ckpts", "last.ckpt")
    code, log = run_program(mode, root, out, workers)
    assert code != 0, log
    assert torch.load(last, weights_only=True)["progress"]["global_step"] == 12, log
    code, log = run_program("resume", root, out, workers)
    assert code == 0, log
    result = torch.load(out, weights_only=True)
    assert result["ckpt"] == last and result["steps"] == R.EPOCHS * STEPS_PER_EPOCH
    assert_equal_weights(result["weights"], runs["ranks"][0]["ref"])


def test_fsdp_program_with_a_rank_killed_resumes_bitwise_from_its_sharded_checkpoint(tmp_path):
    # The same program under fsdp: rank 1 SIGKILLed at step 13 ends the job; the sharded last.ckpt of step 12
    # is whole, and the resumed run ends bitwise where an uninterrupted fsdp run ends.
    straight = str(tmp_path / "straight.pt")
    code, log = run_program("resume", str(tmp_path / "straight"), straight, 0, "fsdp")  # no checkpoint yet
    assert code == 0, log
    root, out = str(tmp_path / "run"), str(tmp_path / "result.pt")
    last = os.path.join(root, "ckpts", "last.ckpt")
    code, log = run_program("kill", root, out, 0, "fsdp")
    assert code != 0, log
    assert os.path.isdir(last) and load_checkpoint(last)["progress"]["global_step"] == 12, log
    code, log = run_program("resume", root, out, 0, "fsdp")
    assert code == 0, log
    result, reference = torch.load(out, weights_only=True), torch.load(straight, weights_only=True)
    assert result["ckpt"] == last and result["steps"] == R.EPOCHS * STEPS_PER_EPOCH
    assert_equal_weights(result["weights"], reference["weights"])


@pytest.mark.filterwarnings("ignore:ModelCheckpoint. the checkpoint's callback state")  # resumed into another dir
def test_two_ranks_to_one_trains_each_sample_once_per_epoch(runs):
    path = os.path.join(runs["root"], "from_2_ranks.ckpt")
    ckpt = torch.load(path, weights_only=True)
    progress = ckpt["progress"]
    assert (progress["current_epoch"], progress["batch_in_epoch"], ckpt["sampler"]["position"]) == (1, 2, 16)
    with pytest.warns(UserWarning, match="per-rank random streams"):
        module, trainer = R.fit(os.path.join(runs["root"], "to_single"), ckpt_path=path)
    seen = module.seen
    rest = R.N - 16
    assert sorted(seen[:rest]) == sorted(epoch_order(path)[16:])  # the unseen part of epoch 1's global order
    assert sorted(seen[rest:]) == list(range(R.N))  # epoch 2 whole
    assert trainer.global_step == 8 + rest // R.BATCH + R.N // R.BATCH


def test_one_rank_to_two_trains_each_sample_once_per_epoch(runs):
    path = runs["single_ckpt"]
    seen = [r["from_single_seen"] for r in runs["ranks"]]
    rest = (R.N - 16) // WORLD  # samples per rank left in epoch 1
    epoch1 = seen[0][:rest] + seen[1][:rest]
    assert sorted(epoch1) == sorted(epoch_order(path)[16:])
    epoch2 = seen[0][rest:] + seen[1][rest:]
    assert sorted(epoch2) == list(range(R.N))


def resume_on_three(rank: int, world: int, root: str, ckpt: str) -> tuple[list[int], int]:
    _join(rank, world)
    every_4 = R.ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=4, save_top_k=-1)
    module, trainer = R.fit(root, 0, ckpt_path=ckpt, checkpoint=every_4, batch_size=1, strategy="ddp", devices=world)
    return module.seen, trainer.global_step


@pytest.mark.filterwarnings("ignore:ModelCheckpoint. the checkpoint's callback state")
def test_one_rank_to_three_with_what_is_left_not_a_multiple_of_three(tmp_path):
    # Batch 1, stopped after 16 steps: 32 samples of epoch 0 are left, which 3 ranks cannot share evenly.
    # Every rank must still take the same number of steps (11, one sample padded twice), or the ranks
    # with fewer would leave the others waiting in the gradient all-reduce.
    single = str(tmp_path / "single")
    with pytest.raises(RuntimeError):
        R.fit(single, callbacks=[R.StopAt(17)], batch_size=1)
    ckpt = os.path.join(single, "ckpts", "last.ckpt")
    assert torch.load(ckpt, weights_only=True)["sampler"]["position"] == 16
    ranks = run_ranks(resume_on_three, 3, str(tmp_path / "three"), ckpt, timeout=100)
    steps = {global_step for _, global_step in ranks}
    assert steps == {16 + 11 + 2 * 16}  # 11 steps to end epoch 0, then 48 / 3 = 16 per epoch
    epoch0 = [i for seen, _ in ranks for i in seen[:11]]
    order = epoch_order(ckpt)
    assert sorted(epoch0) == sorted(order[16:] + order[:1])  # every unseen sample, padded with the order's first
    for epoch in (1, 2):
        assert sorted(i for seen, _ in ranks for i in seen[11 + 16 * (epoch - 1) : 11 + 16 * epoch]) == list(range(R.N))
    # Checkpoints written later in the resumed epoch record the real global position (16 + 3 per step).
    for step, position in ((20, 28), (24, 40)):
        saved = torch.load(str(tmp_path / "three" / "ckpts" / f"epoch=0-step={step}.ckpt"), weights_only=True)
        assert saved["sampler"]["position"] == position


if __name__ == "__main__":
    atexit.register(gc.freeze)  # end without the shutdown garbage collection: see tests/conftest.py
    program(*sys.argv[1:6])
