"""``common_prefix_len``: the bisection agrees with a plain walk over the ids."""

from hypothesis import given
from hypothesis import strategies as st

from radixserve.cache.token_prefix import common_prefix_len

ids = st.lists(st.integers(0, 2), max_size=40)  # a small alphabet: long shared prefixes are common


@given(ids, ids, st.one_of(st.none(), st.integers(0, 50)), st.booleans())
def test_the_longest_common_prefix_up_to_the_limit(a, b, limit, b_as_tuple):
    walked = 0
    while walked < min(len(a), len(b)) and a[walked] == b[walked]:
        walked += 1
    want = walked if limit is None else min(walked, limit)
    assert common_prefix_len(a, tuple(b) if b_as_tuple else b, limit) == want
