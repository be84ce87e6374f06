"""Property-based tests: random shapes, layouts and flag patterns against the references."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_triton.scan import tiles
from cases import ESTIMATORS, FLAG_DTYPES, assert_close, make_case

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(name=st.sampled_from(ESTIMATORS), T=st.integers(1, 90), n=st.integers(1, 7),
       layout=st.sampled_from(["time-major", "batch-major", "transposed-view"]),
       backend=st.sampled_from(["torch", "triton"]), flag_dtype=st.sampled_from(FLAG_DTYPES),
       p_term=st.sampled_from([0.0, 0.05, 0.5, 1.0]), p_trunc=st.sampled_from([0.0, 0.1, 1.0]),
       trunc=st.booleans(), seed=st.integers(0, 2**16))
def test_random_cases(name, T, n, layout, backend, flag_dtype, p_term, p_trunc, trunc, seed,
                      device):
    case = make_case(name, T, (n,), device=device, flag_dtype=flag_dtype, trunc=trunc,
                     p_term=p_term, p_trunc=p_trunc, seed=seed)
    assert_close(case.call(layout, backend=backend), case.reference())


@SETTINGS
@given(name=st.sampled_from(ESTIMATORS), T=st.integers(17, 200), n=st.integers(1, 4),
       block_t=st.sampled_from([16, 32]), window=st.sampled_from([1, 2, 4]),
       depth=st.sampled_from([0, 1, 3]), walk=st.booleans(), time_major=st.booleans(),
       sub=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_random_splits(name, T, n, block_t, window, depth, walk, time_major, sub, seed, device):
    """Any split of the time axis into tiles, carried by look-back (any window, read whole or in
    part) or by a program walking its row, and time-major tiles in any number of sub-tiles, give
    the same result."""
    case = make_case(name, T, (n,), device=device, seed=seed)
    with tiles.override(block_t=block_t, block_b=2, window=window, depth=depth, walk=walk,
                         sub=sub):
        out = case.call("time-major" if time_major else "batch-major", backend="triton")
    assert_close(out, case.reference())
