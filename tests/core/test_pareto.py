from hypothesis import given
from hypothesis import strategies as st

from kareus.core.pareto import pareto_mask

points = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=60)


def _dominates(a, b):
    return a[0] <= b[0] and a[1] <= b[1] and a != b


@given(points)
def test_pareto_mask_matches_the_definition(pts):
    mask = pareto_mask(pts)
    for p, keep in zip(pts, mask):
        dominated = any(_dominates(q, p) for q in pts)
        assert keep == (not dominated)


def test_examples():
    assert pareto_mask([]) == []
    assert pareto_mask([(1, 5), (2, 2), (3, 3), (0.5, 9)]) == [True, True, False, True]


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=30))
def test_pareto_front_keeps_the_undominated_by_their_first_objective(points):
    from kareus.core.pareto import pareto_front

    items = [{"t": t, "e": e, "i": i} for i, (t, e) in enumerate(points)]
    front = pareto_front(items, lambda x: (x["t"], x["e"]))
    assert [x["t"] for x in front] == sorted(x["t"] for x in front)
    for x in items:
        dominated = any(y["t"] <= x["t"] and y["e"] <= x["e"]
                        and (y["t"], y["e"]) != (x["t"], x["e"]) for y in items)
        assert (x in front) == (not dominated)
