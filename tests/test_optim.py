import pytest
import torch
import torchvision
from torch import nn

from tutorial_lib.optim import param_groups, parameter_kinds


def _counts(groups):
    return {g["name"]: len(g["params"]) for g in groups}


def test_resnet50_groups_decay_53_convs_and_fc_weight_and_nothing_else():
    model = torchvision.models.resnet50()
    groups = param_groups(model, weight_decay=1e-4)
    assert _counts(groups) == {"decay": 54, "no_decay_norm": 53, "no_decay_bias": 54}
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = [names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]]
    modules = dict(model.named_modules())
    assert sorted(n for n in decayed if isinstance(modules[n.rsplit(".", 1)[0]], nn.Conv2d)) == sorted(
        f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
    assert "fc.weight" in decayed and len(decayed) == 54
    assert sum(len(g["params"]) for g in groups if g["weight_decay"] == 0) == 107


def test_every_resnet50_tensor_is_in_exactly_one_group():
    model = torchvision.models.resnet50()
    ids = [id(p) for g in param_groups(model, 1e-4) for p in g["params"]]
    assert len(ids) == len(set(ids)) == 161
    assert set(ids) == {id(p) for p in model.parameters()}


def test_downsample_batchnorms_are_not_decayed_although_their_names_lack_bn():
    kinds = parameter_kinds(torchvision.models.resnet50())
    for layer in range(1, 5):
        assert kinds[f"layer{layer}.0.downsample.1.weight"] == "no_decay_norm"
        assert kinds[f"layer{layer}.0.downsample.0.weight"] == "decay"


def test_groups_carry_the_requested_decays_and_drop_empty_groups():
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.LayerNorm(3, bias=False))
    groups = param_groups(model, weight_decay=0.05, norm_weight_decay=0.01, bias_weight_decay=0.2)
    assert [(g["name"], g["weight_decay"]) for g in groups] == [("decay", 0.05), ("no_decay_norm", 0.01)]


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(4), nn.SyncBatchNorm(4), nn.InstanceNorm1d(4, affine=True),
                                  nn.GroupNorm(2, 4), nn.LayerNorm(4), nn.RMSNorm(4)])
def test_every_normalization_type_is_grouped_as_norm_whatever_its_name(norm):
    model = nn.Sequential()
    model.add_module("x", nn.Linear(4, 4))
    model.add_module("y", norm)
    kinds = parameter_kinds(model)
    assert kinds["x.weight"] == "decay" and kinds["x.bias"] == "no_decay_bias"
    assert kinds["y.weight"] == "no_decay_norm"
    if "y.bias" in kinds:
        assert kinds["y.bias"] == "no_decay_bias"


def test_shared_and_frozen_parameters_are_listed_at_most_once():
    shared = nn.Linear(2, 2)
    frozen = nn.Linear(2, 2)
    frozen.requires_grad_(False)
    model = nn.Sequential(shared, shared, frozen)
    ids = [id(p) for g in param_groups(model, 1e-4) for p in g["params"]]
    assert sorted(ids) == sorted([id(shared.weight), id(shared.bias)])


def test_sgd_with_the_groups_shrinks_only_decayed_weights():
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.optim.SGD(param_groups(model, weight_decay=0.5), lr=1.0).step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["0.weight"].detach(), 0.5 * before["0.weight"])
    for name in ["0.bias", "1.weight", "1.bias"]:
        torch.testing.assert_close(after[name].detach(), before[name])


def test_negative_weight_decay_is_refused_with_the_group_name():
    with pytest.raises(ValueError, match="no_decay_bias"):
        param_groups(nn.Linear(2, 2), 1e-4, bias_weight_decay=-1.0)
