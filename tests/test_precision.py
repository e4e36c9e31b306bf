import math

import pytest
import torch
from torch import nn

from tutorial_lib.precision import (
    FORMATS,
    autocast_output_dtypes,
    decode_bits,
    draw_bit_layout,
    finfo_table,
    float_bits,
    sequential_sum,
    spacing,
)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_decoded_bits_equal_the_stored_value_for_normal_subnormal_and_special_numbers(dtype):
    values = [
        0.0,
        -0.0,
        1.0,
        -2.5,
        0.1,
        1e-7,
        1e-40,
        65504.0,
        3e38,
        float("inf"),
        float("-inf"),
        *torch.randn(100, generator=torch.Generator().manual_seed(1)).mul(100).tolist(),
    ]
    E, M = FORMATS[dtype]
    for x in values:
        b = float_bits(x, dtype)
        assert (len(b["sign"]), len(b["exponent"]), len(b["mantissa"])) == (1, E, M)
        assert decode_bits(b["sign"], b["exponent"], b["mantissa"]) == b["stored"], (dtype, x)


def test_known_bit_patterns_of_minus_6_5():
    assert float_bits(-6.5, torch.float32) == {
        "sign": "1",
        "exponent": "10000001",
        "mantissa": "101" + "0" * 20,
        "stored": -6.5,
    }
    assert float_bits(-6.5, torch.float16)["exponent"] == "10001"
    assert float_bits(-6.5, torch.bfloat16)["mantissa"] == "1010000"
    assert math.isnan(decode_bits("0", "11111", "0000000001"))


def test_float_bits_refuses_other_dtypes():
    with pytest.raises(ValueError, match="dtype must be one of"):
        float_bits(1.0, torch.float64)


def test_finfo_table_follows_the_bit_layout_and_fp16_max_is_65504():
    rows = {r["dtype"]: r for r in finfo_table()}
    assert rows["float16"]["max"] == 65504.0
    assert rows["bfloat16"]["eps"] == 2**-7 and rows["float16"]["eps"] == 2**-10
    assert rows["bfloat16"]["smallest_normal"] == rows["float32"]["smallest_normal"] == 2.0**-126
    assert rows["float16"]["smallest_subnormal"] == 2.0**-24


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
    upstream = torch.full((16, 4), 2.0**-26)  # below half of fp16's smallest subnormal

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
    assert rel_error(grad(torch.float16, 2.0**16)) < 1e-3
    assert rel_error(grad(torch.bfloat16)) < 1e-2


def _drawn_fields(ax):
    drawn = {}
    for t in ax.texts:
        if t.get_gid():
            name, field, i = t.get_gid().split("|")
            drawn.setdefault(name, {}).setdefault(field, {})[int(i)] = t.get_text()
    return {
        name: {f: "".join(bits[i] for i in sorted(bits)) for f, bits in fields.items()}
        for name, fields in drawn.items()
    }


@pytest.mark.parametrize("x", [-0.1, 3.0, 65504.0, 1e-6])
def test_draw_bit_layout_draws_each_formats_fields_and_they_decode_to_the_stored_value(x):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    draw_bit_layout(ax, x)
    drawn = _drawn_fields(ax)
    plt.close(fig)
    widths = {"float32": (1, 8, 23), "float16": (1, 5, 10), "bfloat16": (1, 8, 7)}
    assert set(drawn) == set(widths)
    for dtype in FORMATS:
        name = str(dtype).replace("torch.", "")
        fields = drawn[name]
        assert tuple(len(fields[f]) for f in ("sign", "exponent", "mantissa")) == widths[name]
        assert decode_bits(fields["sign"], fields["exponent"], fields["mantissa"]) == torch.tensor(x).to(dtype).item()


def test_bf16_rounding_error_is_at_most_2_to_the_minus_8_and_reaches_it_above_a_power_of_two():
    u = 2.0**-8
    x = torch.tensor([1 + u * 1.001, 1.5 + u * 0.999, 3.0], dtype=torch.float64)  # just past / before midpoints
    err = (x.to(torch.bfloat16).double() - x).abs() / x
    assert (err <= u).all()
    assert err[0] > 0.99 * u  # just above 1: the largest relative error
    assert err[1] < 0.7 * u  # higher in the binade the same absolute error is relatively smaller
    assert err[2] == 0


def test_notebook_03_states_bf16_precision_one_way():
    # one statement: spacing 0.39-0.78 %, largest rounding error 2^-8 = 0.39 %; never the old "0.4 %" / "0.8 %"
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[1] / "notebooks" / "03_mixed_precision.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    for stale in ("0.4 %", "0.8 %", "≈ 0.8", "usual 0.4"):
        assert stale not in text, stale
    assert "0.39–0.78 %" in text and "2⁻⁸ ≈ 0.39 %" in text
