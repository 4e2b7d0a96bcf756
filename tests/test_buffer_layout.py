"""The staging-ring sizing of cc/low_latency/region_layout.h and cc/intranode/launch_config.cu,
through the extension (no GPU needed: pure host arithmetic; skipped where
jax_ep._C is not built). These numbers decide whether a call runs at all."""
from __future__ import annotations

import pytest

from jax_ep import extension

C = extension.load()
pytestmark = pytest.mark.skipif(C is None, reason="needs the jax_ep._C extension")

GIB = 1 << 30
V3_ROW = 7168 * 2      # bf16 row bytes at V3
FP8_ROW, FP8_SCALES = 7168, 56 * 4


def err(combine, R, T, sms, row, srow, sym, device_sms=132, chunk=0):
    return C.staging_error(combine, R, T, sms, device_sms, chunk, row, srow, sym)


def test_default_buffer_runs_any_t_at_ep2():
    assert C.DEFAULT_BUFFER_BYTES == GIB and 0 < C.CTRL_BYTES < GIB // 16
    for T in (1, 4096, 16384, 65536, 262144):
        for combine in (False, True):
            assert err(combine, 2, T, 0, V3_ROW, 0, GIB) == "", T
        assert err(False, 2, T, 0, FP8_ROW, FP8_SCALES, GIB) == "", T
    assert C.symmetric_buffer_bytes(2, 10 ** 6, 4 * 8192, 256) == GIB   # capped: rings wrap


def test_ep2_small_configs_get_small_buffers_that_do_not_wrap():
    sym = C.symmetric_buffer_bytes(2, 4096, V3_ROW, 0)
    assert sym < GIB // 2
    half = C.stage_half_bytes(sym)
    chunks_per_block = -(-4096 // 8 // 132)
    assert C.ring_depth(2, 4096, 132, 8, V3_ROW, 0, half) >= chunks_per_block
    assert err(False, 2, 4096, 0, V3_ROW, 0, sym) == ""


@pytest.mark.parametrize("R", [3, 4, 8])
def test_default_buffer_runs_any_t_up_to_ep8(R):
    # issue 14: the 1 GiB default runs any T at EP <= 8, H <= 8192, bf16 or
    # f32 rows (the rings wrap), at any SM budget
    for T in (1, 128, 4096, 16384, 65536):
        for sms in (0, 24, 132):
            for row in (8192 * 2, 8192 * 4):
                assert err(False, R, T, sms, row, 0, GIB) == "", (T, sms, row)
                assert err(True, R, T, sms, row, 0, GIB) == "", (T, sms, row)
            assert err(False, R, T, sms, 8192, 64 * 4, GIB) == "", (T, sms)
    assert C.symmetric_buffer_bytes(R, 65536, 8192 * 4, 256) == GIB   # capped: rings wrap
    # small configs still get a buffer whose rings never wrap
    sym = C.symmetric_buffer_bytes(R, 128, V3_ROW, FP8_SCALES)
    assert sym < GIB and err(False, R, 128, 0, V3_ROW, 0, sym) == ""


def test_tiny_buffers_fail_clearly():
    msg = err(False, 2, 4096, 0, V3_ROW, 0, C.CTRL_BYTES + (1 << 20))
    assert "cannot hold one ring slot" in msg and "buffer_bytes" in msg
    assert C.ring_depth(2, 4096, 132, 1, V3_ROW, 0, 1000) == 0


def test_ring_depth_is_monotonic_and_capped():
    prev = 0
    for half_mib in (1, 4, 16, 64, 256, 1024):
        d = C.ring_depth(2, 262144, 132, 8, V3_ROW, 0, half_mib << 20)
        assert d >= prev
        prev = d
    assert prev == 64   # kMaxDepth (249 chunks per block)
    assert C.ring_depth(2, 65536, 132, 8, V3_ROW, 0, GIB) == 63   # every chunk of a block


def _align(n, a=256):
    return -(-n // a) * a


def _ll_staging(E, Tm, K, H):
    """The put transport's staging (one copy, not per parity): Tmax dispatch
    rows (bf16 width; a token is cast once and put to each of its ranks) +
    scale rows, and min(E, MAX_RANKS * K) * Tmax combine rows (f32 width), the
    most a rank receives at any R <= MAX_RANKS."""
    comb_rows = min(E, C.MAX_RANKS * K) * Tm
    return _align(Tm * 2 * H) + _align(Tm * (H // 128) * 4) + _align(comb_rows * 4 * H)


def test_low_latency_region_size():
    """The runtime's low-latency region (buffer_layout.h ll_region_layout): both
    parities of MAX_RANKS * Tmax dispatch token rows at bf16 width + f32 scale
    rows (one row per (token, rank)), E * Tmax int32 info words and Tmax * K
    combine rows at f32 width, plus control, count and flag words and the put
    transport's staging; independent of R; none for an empty shape."""
    E, Tm, K, H = 256, 128, 8, 7168
    rows = C.MAX_RANKS * Tm
    per_parity = (_align(rows * 2 * H) + _align(rows * (H // 128) * 4) + _align(E * Tm * 4)
                  + _align(Tm * K * 4 * H))
    head = _align(2 * 128) + _align(2 * E * 8) + _align(2 * C.MAX_RANKS * 8)
    stage = _ll_staging(E, Tm, K, H)
    assert C.ll_region_size((E, Tm, K, H)) == head + 2 * per_parity + stage
    # ~0.08 GiB of receive areas (0.94 GiB with one row per pair),
    # + 0.22 GiB of staging at V3-decode
    assert 0.2 * GIB < stage < 0.23 * GIB
    assert 0.28 * GIB < C.ll_region_size((E, Tm, K, H)) < 0.32 * GIB
    assert C.ll_region_size((0, 0, 0, 0)) == 0
    # few experts: the combine staging is bounded by E * Tmax rows (all of them)
    E, Tm, K, H = 16, 33, 4, 256
    rows = C.MAX_RANKS * Tm
    per_parity = (_align(rows * 2 * H) + _align(rows * (H // 128) * 4) + _align(E * Tm * 4)
                  + _align(Tm * K * 4 * H))
    head = _align(2 * 128) + _align(2 * E * 8) + _align(2 * C.MAX_RANKS * 8)
    assert min(E, C.MAX_RANKS * K) == E
    assert C.ll_region_size((E, Tm, K, H)) == head + 2 * per_parity + _ll_staging(E, Tm, K, H)


def test_loopback_ll_region_has_no_staging():
    """The loopback harness's exact-rows region (ll_region_bytes: P2P only)
    has no staging: both parities (R * Tmax token rows, E * Tmax info words),
    control, count and flag words for R ranks."""
    R, E, Tm, K = 2, 16, 33, 4
    row, srow, crow = 256, 8, 512
    rows = R * Tm
    per_parity = (_align(rows * row) + _align(rows * srow) + _align(E * Tm * 4)
                  + _align(Tm * K * crow))
    head = _align(2 * 128) + _align(2 * E * 8) + _align(2 * R * 8)
    assert C.ll_region_bytes(R, E, Tm, K, row, srow, crow) == head + 2 * per_parity


def test_low_latency_region_bytes_api():
    import jax_ep

    cfg = jax_ep.EpConfig(num_experts=256, topk=8, max_tokens_per_rank=128, hidden=7168)
    assert jax_ep.low_latency_region_bytes(cfg) == C.ll_region_size((256, 128, 8, 7168))
    with pytest.raises(TypeError, match="EpConfig"):
        jax_ep.low_latency_region_bytes((256, 128, 8, 7168))
