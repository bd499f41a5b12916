"""WindowPick (csrc/max_pool3d.h), PyTorch's rule for the element a max-pool window picks, on the host:
first_maximum (the pick from the elements' maximum, for elements none of which is NaN: the first element equal
to it, with its own value) against update() fed the same elements one by one, on windows full of ties, signed
zeros and infinities. Built as a small extension of its own (torch.utils.cpp_extension.load_inline)."""
import os

import pytest
import torch

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")

SOURCE = r"""
#include <torch/extension.h>

#include <algorithm>

#include "max_pool3d.h"

// Each row of `values` (rows of 4 floats, at offsets first, first + 2, ... of their window): update()'s pick
// and first_maximum's, as (value, offset, value, offset).
at::Tensor both_picks(const at::Tensor& values, int64_t first) {
  const at::Tensor v = values.contiguous();
  at::Tensor out = at::empty({v.size(0), 4}, v.options());
  const float* in = v.const_data_ptr<float>();
  float* picks = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < v.size(0); ++r) {
    float row[4];
    fused_ops::WindowPick<float> one_by_one;
    for (int i = 0; i < 4; ++i) {
      row[i] = in[4 * r + i];
      one_by_one.update(row[i], static_cast<int>(first) + 2 * i);
    }
    const float most = std::max(std::max(row[0], row[1]), std::max(row[2], row[3]));
    const auto from_maximum = fused_ops::WindowPick<float>::first_maximum(row, most, static_cast<int>(first), 2);
    picks[4 * r] = one_by_one.value;
    picks[4 * r + 1] = static_cast<float>(one_by_one.offset);
    picks[4 * r + 2] = from_maximum.value;
    picks[4 * r + 3] = static_cast<float>(from_maximum.offset);
  }
  return out;
}
"""


@pytest.fixture(scope="module")
def window_pick():
    from torch.utils.cpp_extension import load_inline

    return load_inline("window_pick_test", cpp_sources=SOURCE, functions=["both_picks"],
                       extra_include_paths=[CSRC], extra_cflags=["-O1"])


@pytest.mark.parametrize("first", [0, 1])
def test_first_maximum_picks_as_update_does(window_pick, first):
    # (few distinct values: most windows tie; -0.0 and 0.0 compare equal, and the pick's value is the first's)
    palette = torch.tensor([-2.0, -0.0, 0.0, 1.0, float("inf"), float("-inf")])
    generator = torch.Generator().manual_seed(first)
    values = palette[torch.randint(0, len(palette), (4096, 4), generator=generator)]
    values = torch.cat([values, torch.randn(512, 4, generator=generator)])
    picks = window_pick.both_picks(values, first)
    assert torch.equal(picks[:, 1], picks[:, 3]), "offsets"
    assert torch.equal(picks[:, 0], picks[:, 2]) and torch.equal(picks[:, 0].signbit(), picks[:, 2].signbit())
    # (and the rule itself: the first maximum, its offset first + 2 i)
    expected = values.argmax(1) * 2 + first  # (torch.argmax: the first maximal index)
    assert torch.equal(picks[:, 1].long(), expected)
