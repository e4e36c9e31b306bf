import math

import pytest
import torch
from torch import nn

from tutorial_lib.precision import (FORMATS, autocast_output_dtypes, decode_bits, finfo_table, float_bits,
                                    sequential_sum, spacing)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_decoded_bits_equal_the_stored_value_for_normal_subnormal_and_special_numbers(dtype):
    values = [0.0, -0.0, 1.0, -2.5, 0.1, 1e-7, 1e-40, 65504.0, 3e38, float("inf"), float("-inf"),
              *torch.randn(100, generator=torch.Generator().manual_seed(1)).mul(100).tolist()]
    E, M = FORMATS[dtype]
    for x in values:
        b = float_bits(x, dtype)
        assert (len(b["sign"]), len(b["exponent"]), len(b["mantissa"])) == (1, E, M)
        assert decode_bits(b["sign"], b["exponent"], b["mantissa"]) == b["stored"], (dtype, x)


def test_known_bit_patterns_of_minus_6_5():
    assert float_bits(-6.5, torch.float32) == {"sign": "1", "exponent": "10000001",
                                               "mantissa": "101" + "0" * 20, "stored": -6.5}
    assert float_bits(-6.5, torch.float16)["exponent"] == "10001"
    assert float_bits(-6.5, torch.bfloat16)["mantissa"] == "1010000"
    assert math.isnan(decode_bits("0", "11111", "0000000001"))


def test_float_bits_refuses_other_dtypes():
    with pytest.raises(ValueError, match="dtype must be one of"):
        float_bits(1.0, torch.float64)


def test_finfo_table_follows_the_bit_layout_and_fp16_max_is_65504():
    rows = {r["dtype"]: r for r in finfo_table()}
    assert rows["float16"]["max"] == 65504.0
    assert rows["bfloat16"]["eps"] == 2 ** -7 and rows["float16"]["eps"] == 2 ** -10
    assert rows["bfloat16"]["smallest_normal"] == rows["float32"]["smallest_normal"] == 2.0 ** -126
    assert rows["float16"]["smallest_subnormal"] == 2.0 ** -24


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_spacing_is_2_to_the_minus_m_relative_to_the_power_of_two_below(dtype):
    M = FORMATS[dtype][1]
    x = torch.tensor([1.0, 1.5, 3.0, 1000.0], dtype=dtype)
    expected = torch.tensor([2.0 ** (math.floor(math.log2(v)) - M) for v in x.float().tolist()])
    assert torch.equal(spacing(x), expected)


def test_bf16_running_sum_stalls_while_fp32_does_not():
    values = torch.full((1000,), 0.01)
    assert sequential_sum(values, torch.bfloat16) == 4.0
    assert sequential_sum(values, torch.float32) == pytest.approx(10.0, rel=1e-4)


def test_autocast_runs_conv_and_linear_in_bf16_and_keeps_weights_fp32():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    dtypes = autocast_output_dtypes(model, torch.randn(2, 3, 6, 6))
    assert dtypes == {"0 (Conv2d)": torch.bfloat16, "1 (Flatten)": torch.bfloat16, "2 (Linear)": torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(not m._forward_hooks for m in model.modules()), "hooks must be removed"


def test_fp16_gradients_underflow_without_loss_scaling_and_bf16_ones_do_not():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    x = torch.randn(16, 8)
    upstream = torch.full((16, 4), 2.0 ** -26)      # below half of fp16's smallest subnormal

    def grad(dtype, scale=1.0):
        layer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = layer(x)
        (out.float() * upstream).sum().mul(scale).backward()
        return layer.weight.grad / scale

    def rel_error(g):
        return ((g - reference).norm() / reference.norm()).item()

    reference = upstream.T @ x
    assert torch.count_nonzero(grad(torch.float16)) == 0
    assert rel_error(grad(torch.float16, 2.0 ** 16)) < 1e-3
    assert rel_error(grad(torch.bfloat16)) < 1e-2
