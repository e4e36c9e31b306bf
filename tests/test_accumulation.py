"""Unit tests of tutorial_lib.accumulation (notebook 01): accumulation equals a big batch, window scaling."""

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from tutorial_lib.accumulation import (
    accumulate_gradients,
    accumulation_steps_for,
    accumulation_windows,
    activation_bytes,
    draw_timeline,
    gradient_snapshot,
    is_optimizer_step,
    loss_scale,
    make_toy_cnn,
    max_abs_difference,
    run_accumulation_timeline,
    split_micro_batches,
    toy_batch,
    train_epoch_with_accumulation,
    training_state_bytes,
)

loss_fn = nn.CrossEntropyLoss()


def full_batch_gradient(model, inputs, targets):
    model.zero_grad(set_to_none=True)
    loss_fn(model(inputs), targets).backward()
    return gradient_snapshot(model)


def accumulated_gradient(model, inputs, targets, k):
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, loss_fn, inputs, targets, gradient_accumulation_steps=k)
    return gradient_snapshot(model)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_accumulated_micro_batches_give_the_big_batch_gradient(k):
    model = make_toy_cnn(norm="none")
    inputs, targets = toy_batch(32)
    reference = full_batch_gradient(model, inputs, targets)
    assert max_abs_difference(accumulated_gradient(model, inputs, targets, k), reference) <= 1e-6


def test_accumulate_gradients_returns_the_mean_loss_of_the_batch():
    model = make_toy_cnn(norm="none")
    inputs, targets = toy_batch(16)
    with torch.no_grad():
        expected = loss_fn(model(inputs), targets).item()
    assert accumulate_gradients(model, loss_fn, inputs, targets, 4) == pytest.approx(expected, abs=1e-6)


def test_batchnorm_breaks_the_equivalence_and_groupnorm_keeps_it():
    inputs, targets = toy_batch(32)
    errors = {}
    for norm in ["batch", "group"]:
        model = make_toy_cnn(norm=norm)
        reference = full_batch_gradient(model, inputs, targets)
        scale = max(g.abs().max().item() for g in reference.values())
        errors[norm] = max_abs_difference(accumulated_gradient(model, inputs, targets, 4), reference) / scale
    assert errors["batch"] > 1e-3
    assert errors["group"] <= 1e-5


def test_split_micro_batches_makes_consecutive_equal_slices_and_refuses_remainders():
    inputs, targets = torch.arange(12).float()[:, None], torch.arange(12)
    parts = split_micro_batches(inputs, targets, 3)
    assert [y.tolist() for _, y in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="divides the batch size"):
        split_micro_batches(inputs, targets, 5)


def test_accumulation_windows_cover_every_batch_once_with_a_short_last_window():
    windows = accumulation_windows(10, 4)
    assert [list(w) for w in windows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(accumulation_windows(12, 4)) == 3 == math.ceil(12 / 4)
    with pytest.raises(ValueError):
        accumulation_windows(0, 4)


def test_loss_scales_sum_to_one_in_every_window():
    for num_batches, k in [(10, 4), (12, 4), (7, 3), (5, 1), (3, 8)]:
        for window in accumulation_windows(num_batches, k):
            assert sum(loss_scale(i, num_batches, k) for i in window) == pytest.approx(1.0)
    assert loss_scale(9, 10, 4) == 0.5 and loss_scale(0, 10, 4) == 0.25
    with pytest.raises(ValueError):
        loss_scale(10, 10, 4)


def test_optimizer_steps_at_each_window_end_including_the_epoch_end():
    assert [i for i in range(10) if is_optimizer_step(i, 10, 4)] == [3, 7, 9]
    assert [i for i in range(8) if is_optimizer_step(i, 8, 4)] == [3, 7]


def test_epoch_with_accumulation_equals_big_batch_sgd_on_each_window():
    b, num_batches, k = 4, 10, 4
    inputs, targets = toy_batch(b * num_batches, seed=3)
    batches = list(zip(inputs.split(b), targets.split(b)))
    model = make_toy_cnn(norm="none")
    steps = train_epoch_with_accumulation(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn, batches, k
    )
    reference = make_toy_cnn(norm="none")
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for window in accumulation_windows(num_batches, k):
        optimizer.zero_grad()
        loss_fn(
            reference(torch.cat([batches[i][0] for i in window])), torch.cat([batches[i][1] for i in window])
        ).backward()
        optimizer.step()
    assert steps == 3
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())) <= 1e-6


def test_activation_bytes_counts_what_autograd_saves_and_grows_linearly():
    assert activation_bytes(nn.Linear(100, 10), torch.randn(7, 100)) == 7 * 100 * 4
    model = make_toy_cnn(norm="batch")
    one, four = (activation_bytes(model, toy_batch(b)[0]) for b in (1, 4))
    assert one > 0
    assert four == pytest.approx(4 * one, rel=0.02)


def test_training_state_is_weights_grads_and_optimizer_state():
    model = nn.Linear(10, 5)  # 55 fp32 parameters
    assert training_state_bytes(model) == 3 * 55 * 4
    assert training_state_bytes(model, optimizer_states_per_param=2) == 4 * 55 * 4


def test_accumulation_steps_reach_the_target_global_batch():
    assert accumulation_steps_for(256, 32) == 8
    assert accumulation_steps_for(256, 32, num_processes=2) == 4
    with pytest.raises(ValueError, match="not a multiple"):
        accumulation_steps_for(256, 48)


def test_toy_cnn_refuses_an_unknown_norm():
    with pytest.raises(ValueError, match="norm must be one of"):
        make_toy_cnn(norm="layer")


ACCELERATE_LAST_WINDOW = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator
from tutorial_lib.accumulation import gradient_snapshot, loss_scale, make_toy_cnn, max_abs_difference, toy_batch

k, b, n = 4, 4, 10
inputs, targets = toy_batch(b * n, seed=5)
loss_fn = nn.CrossEntropyLoss()
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
model = make_toy_cnn()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
loader = DataLoader(TensorDataset(inputs, targets), batch_size=b)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
reference = make_toy_cnn()
loss_fn(reference(inputs[8 * b:]), targets[8 * b:]).backward()
want = gradient_snapshot(reference)
for fix in (False, True):
    grads = []
    for i, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            if fix:
                loss = loss * k * loss_scale(i, len(loader), k)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grads.append(gradient_snapshot(model))
            optimizer.step()
            optimizer.zero_grad()
    assert len(grads) == 3
    ratio = (grads[-1]["8.weight"].norm() / want["8.weight"].norm()).item()
    print(fix, round(ratio, 4), max_abs_difference(grads[-1], want) <= 1e-6)
"""


@pytest.mark.slow
def test_accelerate_scales_a_short_last_window_by_1_over_k_and_loss_scale_fixes_it():
    # In a fresh interpreter: an Accelerator leaves process-wide state behind.
    out = subprocess.run(
        [sys.executable, "-c", ACCELERATE_LAST_WINDOW], check=True, capture_output=True, text=True, timeout=120
    ).stdout.split("\n")
    assert out[:2] == ["False 0.5 False", "True 1.0 True"], out


# --- accumulation on 2 real processes (gloo): only the last micro-step of a window all-reduces ---------------


@pytest.fixture(scope="module")
def two_process_accumulation():
    return run_accumulation_timeline(gradient_accumulation_steps=3, num_optimizer_steps=2, num_processes=2)


@pytest.mark.slow
def test_only_the_last_micro_step_of_each_window_all_reduces_on_two_processes(two_process_accumulation):
    t = two_process_accumulation
    assert t["num_processes"] == [2, 2]
    assert t["sync_gradients"] == [[False, False, True] * 2] * 2
    for calls in t["allreduces_per_micro_step"]:
        assert [c > 0 for c in calls] == [False, False, True] * 2, calls  # one bucket per sync step here
    # local (no_sync) gradients differ between the processes; after the all-reduce they are identical
    assert t["grads_equal_across_processes"] == [False, False, True] * 2


@pytest.mark.slow
def test_recorded_allreduce_times_are_ordered_and_inside_the_synchronising_backward(two_process_accumulation):
    for r in two_process_accumulation["ranks"]:
        for e in r["events"]:
            backward_start, backward_end = r["micro_steps"][e["step"]]["backward"]
            assert backward_start <= e["start"] <= e["end"] <= backward_end, (e, backward_start, backward_end)
            assert e["bytes"] == 4 * sum(p.numel() for p in make_toy_cnn(width=32).parameters())


@pytest.mark.slow
def test_the_synchronised_accumulated_gradient_is_the_global_batch_gradient(two_process_accumulation):
    # Window 0 runs at the initial weights: its all-reduced gradient must be the gradient of all
    # 2 processes x 3 micro-batches x 8 = 48 samples (accelerate shards batches alternately, so these
    # are the first 48 samples). Tolerance: a float32 sum of n terms computed in another order moves by
    # at most about n * 2**-24 of its terms' magnitude; the longest sums are the first conv's
    # weight gradients, n = 48 images x 16 x 16 positions.
    inputs, targets = toy_batch(8 * 3 * 2 * 2, seed=0)
    model = make_toy_cnn(norm="none", width=32, seed=0)
    reference = full_batch_gradient(model, inputs[:48], targets[:48])
    tolerance = 48 * 16 * 16 * 2.0**-24
    synced = two_process_accumulation["ranks"][0]["grads"][2]
    for name, g in reference.items():
        assert (synced[name] - g).abs().max().item() <= tolerance * g.abs().max().item(), name


def test_draw_timeline_draws_one_bar_per_event_and_returns_the_origin():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [{"lane": "a", "kind": "x", "start": 2.0, "end": 2.5}, {"lane": "b", "kind": "y", "start": 2.1, "end": 2.1}]
    fig, ax = plt.subplots()
    assert draw_timeline(ax, bars, ["a", "b"], {"x": "red", "y": "blue"}) == 2.0
    bar_a, bar_b = ax.collections[:2]
    assert bar_a.get_paths()[0].get_extents().width == 500.0  # 0.5 s drawn in ms
    assert bar_b.get_paths()[0].get_extents().width > 0  # a zero-length event stays visible
    plt.close(fig)
