"""Unbatched input: where the original takes a 4-D (C, D, H, W) input (A and B:
Conv3d, ConvTranspose3d and MaxPool3d take it), the drop-in takes it and returns the
same, gradients included; where the original refuses one (C's sum over dims 1-3, D's
BatchNorm3d), the drop-in refuses it with a clear error."""
import pytest
import torch

from conftest import build_pair, check_matches_original

UNBATCHED = [
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (3, 9, 10, 11)),
    ("Conv3dDivMaxPoolGAPBiasSum", (2, 3, (3, 2, 3), -1.5, (2, 3, 2), (3, 1, 1, 1), 0), (2, 8, 9, 7)),
    ("Conv3dDivMaxPoolGAPBiasSum", (2, 3, 2, 0.5, 3, (1,), -1), (2, 7, 8, 9)),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), (3, 6, 7, 6)),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (2, 3, 3, 2, 1), (2, 5, 6, 7)),
]


@pytest.mark.parametrize("name,args,shape", UNBATCHED, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_unbatched_like_original(name, args, shape, train, device):
    original, fused = build_pair(name, args)
    original.to(device, torch.float64).train(train)
    fused.to(device, torch.float64).train(train)
    check_matches_original(original, fused, torch.rand(shape, dtype=torch.float64, device=device), torch.float64)


@pytest.mark.parametrize("name,args,shape", [
    ("Conv2dAvgPoolSigmoidSum", (3, 4, 3, 2), (3, 9, 10)),
    ("ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0), (3, 4, 5, 6)),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unbatched_refused_like_original(name, args, shape, device):
    original, fused = build_pair(name, args)
    x = torch.rand(shape, device=device)
    with pytest.raises((IndexError, ValueError, RuntimeError)):
        original.to(device)(x)
    with pytest.raises(ValueError, match="expected a .*-D input"):
        fused.to(device)(x)


@pytest.mark.parametrize("name,args,shape", [
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (3, 9, 10)),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), (1, 3, 6, 7, 6, 1)),
], ids=lambda v: v if isinstance(v, str) else None)
def test_wrong_rank_named(name, args, shape):
    _, fused = build_pair(name, args)
    with pytest.raises(ValueError, match=r"expected a 4-D \(unbatched\) or 5-D \(batched\) input"):
        fused(torch.rand(shape))
    with pytest.raises(ValueError, match="expected 3 input channels"):
        fused(torch.rand(2, 9, 10, 11))
