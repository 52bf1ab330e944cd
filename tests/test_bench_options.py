"""`amk bench` option parsing into TritonExecutor options (amk.commands.bench.backend_options)."""

from __future__ import annotations

import argparse

import pytest

from amk.commands.bench import MAX_WORKERS_PER_SM, backend_options, cuda_target
from amk.errors import AmkError


def _args(**kw):
    base = dict(gemv_block="16x512", num_warps=8, gemv_stages=1, prefetch=0, attention_block=32, gemv_unroll=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_blocks_from_flags():
    opts = backend_options(_args(gemv_block="16x1024", gemv_unroll=2, attention_block=64, num_warps=4))
    b = opts["blocks"]
    assert opts["num_warps"] == 4
    assert (b.gemv_n, b.gemv_k, b.gemv_unroll, b.attention_t) == (16, 1024, 2, 64)
    assert b.elide_waits and b.coalesce_signals  # the table sync optimisations are on by default


@pytest.mark.parametrize("kw,needle", [
    (dict(gemv_block="16by512"), "expected NxK"),
    (dict(gemv_block="12x512"), "power of two"),
    (dict(attention_block=48), "--attention-block must be a power of two"),
    (dict(gemv_stages=9), "--gemv-stages"),
    (dict(prefetch=9), "--prefetch"),
])
def test_bad_flags_name_the_flag(kw, needle):
    with pytest.raises(AmkError, match=needle):
        backend_options(_args(**kw))


def test_bad_unroll_is_refused():
    from lowering.triton.runtime import TritonError

    with pytest.raises(TritonError, match="gemv_unroll must be 1, 2, 4, 8 or 16"):
        backend_options(_args(gemv_unroll=3))


def test_cuda_target_allows_several_workers_per_sm():
    props = argparse.Namespace(name="GPU", multi_processor_count=132)
    t = cuda_target(props)
    assert (t.sms, t.max_workers, t.backend) == (132, MAX_WORKERS_PER_SM * 132, "triton")
