"""Tests of tutorial_lib.parallel (notebook 02): real 2-process DDP, ring all-reduce, pipeline and tensor parallelism."""
import socket

import pytest
import torch
import torchvision
from torch import nn

from tutorial_lib.parallel import (ColumnParallelLinear, PipelineModel, RowParallelLinear, bubble_fraction,
                                   idle_fraction, naive_allreduce_bytes, pipeline_devices, pipeline_schedule,
                                   resnet_stages, ring_allreduce, ring_allreduce_bytes, ring_allreduce_seconds,
                                   run_ddp_gradient_check)


@pytest.mark.slow
def test_ddp_two_processes_match_single_process_even_with_port_29500_taken():
    # debug_launcher meets through a FileStore: holding its nominal MASTER_PORT must not matter,
    # so parallel notebooks/tests cannot clash on it.
    with socket.socket() as blocker:
        try:
            blocker.bind(("127.0.0.1", 29500))
            blocker.listen()
        except OSError:
            pass   # already taken by someone else: the same situation
        result = run_ddp_gradient_check(num_processes=2, global_batch=16)
    assert result["num_processes"] == [2, 2]
    first, second = result["shards"]
    assert not set(first) & set(second) and sorted(first + second) == list(range(16))
    assert min(result["local_vs_full"]) > 1e-3          # one shard alone is not the full batch
    assert max(result["synced_vs_full"]) <= 1e-6        # the all-reduced average is
    assert result["weights_equal_rank0"]                # prepare() broadcast process 0's weights


def test_ddp_check_refuses_a_batch_that_does_not_split_evenly():
    with pytest.raises(ValueError, match="divisible"):
        run_ddp_gradient_check(num_processes=2, global_batch=15)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_allreduce_sums_and_sends_2_n_minus_1_over_n_of_the_data(n):
    tensors = [torch.randn(4, 210) for _ in range(n)]   # 840 floats, divisible by every n here
    results, sent = ring_allreduce(tensors)
    total = torch.stack(tensors).sum(0)
    assert all(r.shape == (4, 210) and torch.allclose(r, total, atol=1e-5) for r in results)
    assert sent == [ring_allreduce_bytes(840 * 4, n)] * n


def test_ring_allreduce_handles_sizes_that_do_not_divide_evenly():
    tensors = [torch.randn(10) for _ in range(3)]
    results, sent = ring_allreduce(tensors)
    assert all(torch.allclose(r, sum(tensors), atol=1e-6) for r in results)
    assert sum(sent) == pytest.approx(3 * ring_allreduce_bytes(40, 3))


def test_ring_traffic_stays_below_twice_the_data_while_naive_grows_linearly():
    s = 100e6
    assert ring_allreduce_bytes(s, 1) == 0 and ring_allreduce_bytes(s, 2) == s
    assert all(ring_allreduce_bytes(s, n) < 2 * s for n in [2, 8, 64, 1024])
    assert naive_allreduce_bytes(s, 9) == 8 * s


def test_ring_allreduce_time_is_2_n_minus_1_messages_of_s_over_n():
    assert ring_allreduce_seconds(8e6, 1, 1e9) == 0.0
    assert ring_allreduce_seconds(8e6, 4, 1e9, latency_s=1e-3) == pytest.approx(6 * (1e-3 + 2e6 / 1e9))
    with pytest.raises(ValueError, match="bandwidth"):
        ring_allreduce_seconds(1.0, 2, 0.0)


@pytest.fixture(scope="module")
def resnet50():
    torch.manual_seed(0)
    return torchvision.models.resnet50().eval()


@pytest.mark.parametrize("cut", ["layer1", "layer2", "layer3"])
def test_two_stage_resnet50_equals_the_unsplit_model(resnet50, cut):
    x = torch.randn(1, 3, 32, 32)
    pipeline = PipelineModel(resnet_stages(resnet50, cut), pipeline_devices(2)).eval()
    with torch.no_grad():
        assert torch.allclose(pipeline(x).cpu(), resnet50(x), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_micro_batched_pipeline_gives_the_same_eval_outputs(resnet50):
    x = torch.randn(4, 3, 32, 32)
    pipeline = PipelineModel(resnet_stages(resnet50), ["cpu", "cpu"], micro_batches=2).eval()
    with torch.no_grad():
        expected = resnet50(x)
        assert torch.allclose(pipeline(x), expected, rtol=0, atol=1e-4 * expected.abs().max().item())


def test_resnet_stages_copy_the_layers_and_refuse_unknown_cuts(resnet50):
    first, second = resnet_stages(resnet50, "layer2")
    assert first[0] is not resnet50.conv1 and torch.equal(first[0].weight, resnet50.conv1.weight)
    assert sum(p.numel() for p in first.parameters()) + sum(p.numel() for p in second.parameters()) == \
        sum(p.numel() for p in resnet50.parameters())
    with pytest.raises(ValueError, match="split_after"):
        resnet_stages(resnet50, "layer9")


def test_pipeline_needs_one_device_per_stage():
    with pytest.raises(ValueError, match="one device per stage"):
        PipelineModel([nn.Identity(), nn.Identity()], ["cpu"])
    devices = pipeline_devices(2)
    assert len(devices) == 2
    if torch.cuda.device_count() < 2:
        assert devices == [torch.device("cpu")] * 2


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("micro", [1, 3, 4, 16])
def test_gpipe_schedule_idles_s_minus_1_over_m_plus_s_minus_1(stages, micro):
    tasks = pipeline_schedule(stages, micro, forward_time=1.0, backward_time=2.0)
    assert len(tasks) == 2 * stages * micro
    assert idle_fraction(tasks) == pytest.approx(bubble_fraction(stages, micro), abs=1e-9)
    assert max(t["end"] for t in tasks) == pytest.approx((micro + stages - 1) * 3.0 / micro)


def test_gpipe_schedule_respects_dependencies_and_never_overlaps_a_stage():
    tasks = pipeline_schedule(3, 4)
    end = {(t["kind"], t["micro_batch"], t["stage"]): t["end"] for t in tasks}
    for t in tasks:
        m, s = t["micro_batch"], t["stage"]
        if t["kind"] == "forward" and s > 0:
            assert t["start"] >= end["forward", m, s - 1]
        if t["kind"] == "backward":
            assert t["start"] >= (end["backward", m, s + 1] if s < 2 else end["forward", m, s])
    for s in range(3):
        spans = sorted((t["start"], t["end"]) for t in tasks if t["stage"] == s)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_column_and_row_parallel_linear_equal_the_unsplit_layer(shards, bias):
    torch.manual_seed(0)
    layer = nn.Linear(10, 7, bias=bias)
    x = torch.randn(5, 10)
    with torch.no_grad():
        assert torch.allclose(ColumnParallelLinear(layer, shards)(x), layer(x), atol=1e-6)
        assert torch.allclose(RowParallelLinear(layer, shards)(x), layer(x), atol=1e-6)
    for tp in (ColumnParallelLinear(layer, shards), RowParallelLinear(layer, shards)):
        assert sum(p.numel() for p in tp.parameters()) == sum(p.numel() for p in layer.parameters())


def test_column_then_row_parallel_mlp_needs_only_the_final_sum():
    torch.manual_seed(0)
    fc1, fc2, act = nn.Linear(16, 64), nn.Linear(64, 16), nn.GELU()
    x = torch.randn(3, 16)
    col = ColumnParallelLinear(fc1, 4, gather_output=False)
    row = RowParallelLinear(fc2, 4, input_is_split=True)
    with torch.no_grad():
        assert torch.allclose(row([act(h) for h in col(x)]), fc2(act(fc1(x))), atol=1e-6)


def test_tensor_parallel_refuses_more_shards_than_features():
    with pytest.raises(ValueError, match="out_features"):
        ColumnParallelLinear(nn.Linear(4, 2), 3)
    with pytest.raises(ValueError, match="in_features"):
        RowParallelLinear(nn.Linear(2, 4), 3)
