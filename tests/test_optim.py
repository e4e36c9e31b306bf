import pytest
import torch
import torchvision
from torch import nn

from tutorial_lib.optim import param_groups, parameter_kinds

EXEMPT = dict(norm_weight_decay=0.0, bias_weight_decay=0.0)  # the newer recipes: no decay on norms and biases


def _counts(groups):
    return {g["name"]: len(g["params"]) for g in groups}


def test_default_groups_decay_every_resnet50_tensor_like_the_v1_recipe():
    model = torchvision.models.resnet50()
    groups = param_groups(model, weight_decay=1e-4)
    assert _counts(groups) == {"weight": 54, "norm": 53, "bias": 54}
    assert all(g["weight_decay"] == 1e-4 for g in groups)
    assert sum(len(g["params"]) for g in groups) == 161


def test_param_groups_defaults_equal_the_training_script_defaults():
    # The script passes its flags through; its defaults (None) must mean "decay like --weight_decay" here too.
    from tutorial_lib.flags import default_args

    args = default_args()
    assert args.norm_weight_decay is None and args.bias_weight_decay is None
    groups = param_groups(
        torchvision.models.resnet18(), args.weight_decay, args.norm_weight_decay, args.bias_weight_decay
    )
    assert {g["name"]: g["weight_decay"] for g in groups} == {
        "weight": args.weight_decay,
        "norm": args.weight_decay,
        "bias": args.weight_decay,
    }


def test_one_sgd_step_with_default_groups_equals_sgd_weight_decay_on_all_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    twin = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 3, 8, 8)
    for net, optimizer in [
        (model, torch.optim.SGD(param_groups(model, 0.05), lr=0.1, momentum=0.9)),
        (twin, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)),
    ]:
        for _ in range(3):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name  # same arithmetic per tensor, so bit-identical


def test_exempting_norms_and_biases_decays_53_convs_and_fc_weight_and_nothing_else():
    model = torchvision.models.resnet50()
    groups = param_groups(model, weight_decay=1e-4, **EXEMPT)
    assert _counts(groups) == {"weight": 54, "norm": 53, "bias": 54}
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = [names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]]
    modules = dict(model.named_modules())
    assert sorted(n for n in decayed if isinstance(modules[n.rsplit(".", 1)[0]], nn.Conv2d)) == sorted(
        f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d)
    )
    assert "fc.weight" in decayed and len(decayed) == 54
    assert sum(len(g["params"]) for g in groups if g["weight_decay"] == 0) == 107


@pytest.mark.parametrize("exempt", [{}, EXEMPT])
def test_every_resnet50_tensor_is_in_exactly_one_group(exempt):
    model = torchvision.models.resnet50()
    ids = [id(p) for g in param_groups(model, 1e-4, **exempt) for p in g["params"]]
    assert len(ids) == len(set(ids)) == 161
    assert set(ids) == {id(p) for p in model.parameters()}


def test_downsample_batchnorms_are_norms_although_their_names_lack_bn():
    kinds = parameter_kinds(torchvision.models.resnet50())
    for layer in range(1, 5):
        assert kinds[f"layer{layer}.0.downsample.1.weight"] == "norm"
        assert kinds[f"layer{layer}.0.downsample.0.weight"] == "weight"


def test_groups_carry_the_requested_decays_and_drop_empty_groups():
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.LayerNorm(3, bias=False))
    groups = param_groups(model, weight_decay=0.05, norm_weight_decay=0.01, bias_weight_decay=0.2)
    assert [(g["name"], g["weight_decay"]) for g in groups] == [("weight", 0.05), ("norm", 0.01)]


@pytest.mark.parametrize(
    "norm",
    [
        nn.BatchNorm1d(4),
        nn.SyncBatchNorm(4),
        nn.InstanceNorm1d(4, affine=True),
        nn.GroupNorm(2, 4),
        nn.LayerNorm(4),
        nn.RMSNorm(4),
    ],
)
def test_every_normalization_type_is_grouped_as_norm_whatever_its_name(norm):
    model = nn.Sequential()
    model.add_module("x", nn.Linear(4, 4))
    model.add_module("y", norm)
    kinds = parameter_kinds(model)
    assert kinds["x.weight"] == "weight" and kinds["x.bias"] == "bias"
    assert kinds["y.weight"] == "norm"
    if "y.bias" in kinds:
        assert kinds["y.bias"] == "bias"


def test_shared_and_frozen_parameters_are_listed_at_most_once():
    shared = nn.Linear(2, 2)
    frozen = nn.Linear(2, 2)
    frozen.requires_grad_(False)
    model = nn.Sequential(shared, shared, frozen)
    ids = [id(p) for g in param_groups(model, 1e-4) for p in g["params"]]
    assert sorted(ids) == sorted([id(shared.weight), id(shared.bias)])


@pytest.mark.parametrize("exempt, shrunk", [(EXEMPT, {"0.weight"}), ({}, {"0.weight", "0.bias", "1.weight", "1.bias"})])
def test_sgd_with_the_groups_shrinks_exactly_the_decayed_parameters(exempt, shrunk):
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    with torch.no_grad():
        model[1].bias.fill_(0.3)  # BatchNorm's bias starts at 0, where a decay would be invisible
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.optim.SGD(param_groups(model, weight_decay=0.5, **exempt), lr=1.0).step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), (0.5 if name in shrunk else 1.0) * before[name])


@pytest.mark.parametrize("argument", ["weight_decay", "norm_weight_decay", "bias_weight_decay"])
def test_negative_weight_decay_is_refused_naming_the_argument(argument):
    kwargs = {"weight_decay": 1e-4, argument: -1.0}
    with pytest.raises(ValueError, match=f"^{argument} must be >= 0"):
        param_groups(nn.Linear(2, 2), **kwargs)
