"""Statistics of large samples: the right distribution, in bounds, independent streams."""
import math

import numpy as np
import pytest
import torch
from scipy import special, stats

import metamat
from metamat import reference

N = 1 << 20


def sample(dist, key="s", seed=0, shape=(1024, 1024)):
    return metamat.fill_(torch.empty(shape), dist, seed=seed, key=key).double().flatten().numpy()


def test_uniform():
    x = sample(metamat.Uniform(-2.0, 3.0))
    assert x.min() >= -2.0 and x.max() < 3.0
    assert stats.kstest(x, stats.uniform(loc=-2, scale=5).cdf).pvalue > 1e-3


def test_normal():
    x = sample(metamat.Normal(1.0, 0.5))
    assert abs(x.mean() - 1.0) < 5 * 0.5 / math.sqrt(N)
    assert abs(x.std() - 0.5) < 0.002
    assert stats.kstest(x, stats.norm(loc=1.0, scale=0.5).cdf).pvalue > 1e-3


@pytest.mark.parametrize("a,b", [(-2.0, 2.0), (-0.5, 1.5), (0.5, 3.0)])
def test_truncated_normal_in_bounds_and_distributed(a, b):
    x = sample(metamat.TruncatedNormal(0.0, 1.0, a, b))
    assert x.min() >= np.float32(a) and x.max() <= np.float32(b)
    assert stats.kstest(x, stats.truncnorm(a, b).cdf).pvalue > 1e-3


def test_streams_are_uncorrelated():
    base = sample(metamat.Normal(), key="a", seed=0)
    for other in (sample(metamat.Normal(), key="b", seed=0),
                  sample(metamat.Normal(), key="a", seed=1)):
        assert abs(np.corrcoef(base, other)[0, 1]) < 5 / math.sqrt(N)
    # Neighbouring columns and rows of one table are uncorrelated too.
    t = base.reshape(1024, 1024)
    assert abs(np.corrcoef(t[:, :-1].ravel(), t[:, 1:].ravel())[0, 1]) < 5 / math.sqrt(N)
    assert abs(np.corrcoef(t[:-1].ravel(), t[1:].ravel())[0, 1]) < 5 / math.sqrt(N)


def test_math_helpers_are_accurate():
    x = np.linspace(1e-7, 1.0, 100001, dtype=np.float32)
    got = reference.mm_logf(x).astype(np.float64)
    assert np.max(np.abs(got - np.log(x.astype(np.float64)))) < 2e-6
    k = np.arange(0, 1 << 24, 97, dtype=np.uint32)
    s, c = reference.mm_sincos_turns(k)
    ang = 2 * np.pi * k.astype(np.float64) / (1 << 24)
    assert np.max(np.abs(s - np.sin(ang))) < 1e-6 and np.max(np.abs(c - np.cos(ang))) < 1e-6
    p = np.linspace(-0.999, 0.999, 20001, dtype=np.float32)
    e = reference.mm_erfinvf(p).astype(np.float64)
    assert np.max(np.abs(e - special.erfinv(p.astype(np.float64)))) < 2e-5
