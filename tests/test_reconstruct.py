"""Reconstruction: algebra of the closed form, agreement with EM, bias, intervals, queries."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from service.core.mechanisms.decoy import DecoyGroups
from service.core.mechanisms.decoy_reconstruction import DecoyReconstruction
from service.core.mixing import transition_model
from service.core.prf import ServiceKey, random_ids
from service.core.reconstruct import PublishedCells, Query, QueryError
from service.core.table import Table, write_table
from tests.conftest import synthetic_table

SHARES = [0.15, 0.14, 0.13, 0.12, 0.11, 0.10, 0.09, 0.08, 0.05, 0.03]


def publish(table: Table, seed: int, gamma: int = 5, grouping: str = "size-weighted") -> Table:
    key = ServiceKey.from_seed(seed)
    return DecoyGroups(gamma, grouping).publish(table, random_ids(len(table), key), key).published


def all_queries(table: Table) -> tuple[list[Query], np.ndarray]:
    """Every public value ∧ sensitive value, with its true count."""
    schema = table.schema
    queries, truth = [], []
    for i, a in enumerate(schema["a"].domain):
        for j, s in enumerate(schema["s"].domain):
            queries.append(Query({"a": (a,)}, {"s": s}))
            truth.append(int(((table.codes["a"] == i) & (table.codes["s"] == j)).sum()))
    return queries, np.asarray(truth)


@pytest.mark.parametrize("w", [1, 2, 3])
def test_closed_form_solves_the_kronecker_model_exactly(w):
    """x̂ equals the last state of the solution of Mᵀx = y inside the P block (γ = 2
    keeps the amplification low enough for an identifiable answer at w = 3)."""
    rng = np.random.default_rng(w)
    gamma, n = 2, 10_000
    columns = ["p"] + [f"s{k}" for k in range(w)]
    domains = {"p": ["no", "yes"], **{f"s{k}": ["other", "hit"] for k in range(w)}}
    codes = [rng.integers(0, 2, n)] + [
        (rng.random(n) < 0.1 + 0.03 * k).astype(int) for k in range(w)
    ]
    cells = PublishedCells.from_codes(columns, domains, codes)
    query = Query({"p": ("yes",)}, {f"s{k}": "hit" for k in range(w)})
    reconstruction = DecoyReconstruction(cells, gamma, columns[1:], matrix="corrected", clip=False)
    estimate = reconstruction.estimate(query)

    y = reconstruction._states([query], columns[1:])[0]
    f = [int(np.sum(c)) for c in codes[1:]]
    transition = np.eye(1)
    for fk in f:
        t = (gamma - 1) * fk / (gamma * (n - fk))
        transition = np.kron(transition, [[1 - t, t], [(gamma - 1) / gamma, 1 / gamma]])
    half = len(y) // 2
    solved = np.linalg.solve(transition.T, y[half:])
    assert estimate.estimate == pytest.approx(solved[-1], rel=1e-9, abs=1e-6)
    assert estimate.published == int(y[-1])


@pytest.mark.parametrize("w", [1, 2])
def test_mixing_model_solves_its_kronecker_model_with_the_delta_method_variance(w):
    """x̂ is the answer's component of (⊗M_k)^{-T} y_P, and its variance the delta method's,
    here from a numerical gradient of that estimator in every published count, inside
    and outside P (M_k moves with both)."""
    rng = np.random.default_rng(w)
    gamma, n, m = 3, 30_000, 6
    shares = np.array([0.25, 0.2, 0.2, 0.15, 0.1, 0.1])
    columns = ["p"] + [f"s{k}" for k in range(w)]
    domains = {"p": ["no", "yes"], **{f"s{k}": [f"v{i}" for i in range(m)] for k in range(w)}}
    true = [rng.choice(m, n, p=shares) for _ in range(w)]
    public = (rng.random(n) < 0.3 + 0.05 * true[0]).astype(int)
    # Published values drawn from the model itself: every x̂ state is then positive.
    sensitive = []
    for values in true:
        model = transition_model(np.bincount(values, minlength=m), gamma, "size-weighted")
        cumulative = model.matrix.cumsum(axis=1)[values]
        sensitive.append((rng.random(n)[:, None] > cumulative).sum(axis=1))
    cells = PublishedCells.from_codes(columns, domains, [public, *sensitive])
    target = tuple(range(1, w + 1))
    query = Query({"p": ("yes",)}, {f"s{k}": f"v{target[k]}" for k in range(w)})
    estimate = DecoyReconstruction(cells, gamma, columns[1:], clip=False).estimate(query)

    joint = np.ravel_multi_index(sensitive, (m,) * w)
    y_in = np.bincount(joint[public == 1], minlength=m**w).astype(float)
    y_out = np.bincount(joint[public == 0], minlength=m**w).astype(float)

    def transition(y_in: np.ndarray, y_out: np.ndarray) -> np.ndarray:
        total = (y_in + y_out).reshape((m,) * w)
        matrix = np.eye(1)
        for k in range(w):
            counts = total.sum(axis=tuple(j for j in range(w) if j != k))
            matrix = np.kron(matrix, transition_model(counts, gamma, "size-weighted").matrix)
        return matrix

    def answer(y_in: np.ndarray, y_out: np.ndarray) -> float:
        solved = np.linalg.solve(transition(y_in, y_out).T, y_in)
        return float(solved[np.ravel_multi_index(target, (m,) * w)])

    assert estimate.estimate == pytest.approx(answer(y_in, y_out), rel=1e-9)
    gradient = []
    for y in (y_in, y_out):
        slope = np.empty(len(y))
        for j in range(len(y)):
            up, down = y.copy(), y.copy()
            up[j] += 0.5
            down[j] -= 0.5
            pair = (up, y_out) if y is y_in else (y_in, up)
            low = (down, y_out) if y is y_in else (y_in, down)
            slope[j] = answer(*pair) - answer(*low)
        gradient.append(slope)
    matrix = transition(y_in, y_out)
    # The plug-in counts inside P with negatives set to 0; outside P the variance of an
    # answer's slope is a sum over attributes, so only x̂_¬P's marginals count (positive).
    inside = np.clip(np.linalg.solve(matrix.T, y_in), 0, None)
    outside = np.linalg.solve(matrix.T, y_out)
    for k in range(w):
        assert (outside.reshape((m,) * w).sum(axis=tuple(j for j in range(w) if j != k)) > 0).all()
    variance = 0.0
    for states, slope in zip((inside, outside), gradient, strict=True):
        variance += states @ (matrix @ slope**2 - (matrix @ slope) ** 2)
    z = stats.norm.ppf(0.975)
    assert (estimate.high - estimate.low) / (2 * z) == pytest.approx(np.sqrt(variance), rel=1e-4)


def test_iterative_method_reaches_the_closed_form_at_an_interior_point():
    table = synthetic_table(SHARES, 8000, seed=1)
    cells = PublishedCells.from_table(publish(table, seed=3))
    queries, _ = all_queries(table)
    closed = DecoyReconstruction(cells, 5, ["s"], matrix="corrected", clip=False).estimate_many(
        queries
    )
    iterative = DecoyReconstruction(
        cells, 5, ["s"], method="iterative", matrix="corrected", tolerance=1e-7,
        max_iterations=200_000,
    ).estimate_many(queries)  # fmt: skip
    interior = [c.estimate > 1 for c in closed]
    assert sum(interior) > len(queries) // 2
    for c, i, inside in zip(closed, iterative, interior, strict=True):
        if inside:
            assert i.estimate == pytest.approx(c.estimate, abs=0.05), (c, i)
            assert i.iterations < 200_000


def bias_in_standard_deviations(
    matrix: str = "corrected", grouping: str = "size-weighted", repetitions: int = 300
) -> tuple[np.ndarray, np.ndarray]:
    """Per query: |mean estimate − truth| / sd, and the statistical margin of that mean."""
    table = synthetic_table(SHARES, 6000, seed=2)
    queries, truth = all_queries(table)
    estimates = np.empty((repetitions, len(queries)))
    for r in range(repetitions):
        cells = PublishedCells.from_table(publish(table, seed=1000 + r, grouping=grouping))
        reconstruction = DecoyReconstruction(cells, 5, ["s"], matrix=matrix, clip=False)
        estimates[r] = [e.estimate for e in reconstruction.estimate_many(queries)]
    sd = estimates.std(axis=0, ddof=1)
    bias = np.abs(estimates.mean(axis=0) - truth) / sd
    # Bonferroni over the queries at family α = 0.001, two-sided.
    z = stats.norm.ppf(1 - 0.001 / (2 * len(queries)))
    return bias, np.full(len(queries), z / np.sqrt(repetitions))


# A bias below a quarter of the estimator's own standard deviation adds at most 3%
# to its root-mean-square error (√(1 + 0.25²) = 1.031). Some bias is inherent: the
# transition model assumes every record without s meets s equally often, which no
# grouping can achieve exactly when frequencies differ (seed notes 001 §10.7-10.8).
NEGLIGIBLE_BIAS = 0.25


def test_conjunctive_estimator_is_close_to_unbiased():
    bias, margin = bias_in_standard_deviations()
    assert (bias <= NEGLIGIBLE_BIAS + margin).all(), np.round(bias, 3)


@pytest.mark.parametrize(
    ("matrix", "grouping"), [("paper", "size-weighted"), ("corrected", "anatomy")]
)
def test_the_papers_choices_fail_the_same_bias_check(matrix, grouping):
    bias, margin = bias_in_standard_deviations(matrix, grouping, repetitions=100)
    assert (bias > NEGLIGIBLE_BIAS + margin).any()


def test_sensitive_only_count_is_the_published_count_with_an_exact_interval():
    table = synthetic_table(SHARES, 5000, seed=4)
    published = publish(table, seed=5)
    cells = PublishedCells.from_table(published)
    counts = np.bincount(published.codes["s"], minlength=len(SHARES))
    for method, matrix in [("closed", "corrected"), ("closed", "paper"), ("iterative", "paper")]:
        reconstruction = DecoyReconstruction(cells, 5, ["s"], method=method, matrix=matrix)
        for code, label in enumerate(table.schema["s"].domain):
            estimate = reconstruction.estimate(Query({}, {"s": label}))
            assert estimate.estimate == counts[code]
            assert estimate.low <= counts[code] <= estimate.high


def test_sensitive_only_interval_covers_at_the_nominal_rate():
    """One value per publication (independent trials); one-sided binomial test at α = 0.001."""
    table = synthetic_table(SHARES, 3000, seed=6)
    repetitions, covered = 400, 0
    for r in range(repetitions):
        release = publish(table, seed=2000 + r)
        code = r % len(SHARES)
        kept = np.isin(table.lines, release.lines)
        truth = int((table.codes["s"][kept] == code).sum())
        estimate = DecoyReconstruction(PublishedCells.from_table(release), 5, ["s"]).estimate(
            Query({}, {"s": table.schema["s"].domain[code]})
        )
        covered += estimate.low <= truth <= estimate.high
    assert stats.binom.cdf(covered, repetitions, 0.95) > 0.001, covered


def test_conjunctive_interval_covers_at_least_the_nominal_rate():
    """Model-based intervals are conservative; one query per publication, α = 0.001."""
    table = synthetic_table(SHARES, 6000, seed=7)
    queries, _ = all_queries(table)
    repetitions, covered = 400, 0
    for r in range(repetitions):
        release = publish(table, seed=3000 + r)
        kept = np.isin(table.lines, release.lines)
        query = queries[r % len(queries)]
        a = table.schema["a"].domain.index(query.where["a"][0])
        s = table.schema["s"].domain.index(query.value["s"])
        truth = int(((table.codes["a"][kept] == a) & (table.codes["s"][kept] == s)).sum())
        estimate = DecoyReconstruction(PublishedCells.from_table(release), 5, ["s"]).estimate(query)
        covered += estimate.low <= truth <= estimate.high
    assert stats.binom.cdf(covered, repetitions, 0.95) > 0.001, covered


def test_clipping_keeps_answers_feasible():
    table = synthetic_table(SHARES, 3000, seed=8)
    cells = PublishedCells.from_table(publish(table, seed=9))
    queries, _ = all_queries(table)
    clipped = DecoyReconstruction(cells, 5, ["s"]).estimate_many(queries)
    raw = DecoyReconstruction(cells, 5, ["s"], clip=False).estimate_many(queries)
    assert any(r.estimate < 0 for r in raw)
    for c in clipped:
        assert 0 <= c.low <= c.estimate <= c.high <= c.predicate_rows


def test_value_at_the_eligibility_bound_is_not_identifiable():
    # s0 published N/γ times: as far as the analyst can tell it is in every group,
    # so every record publishes it with probability 1/γ and P ∧ s0 carries no signal.
    columns, domains = ["a", "s"], {"a": ["x", "y"], "s": list("abcde")}
    a = np.tile([0, 1], 500)
    s = np.repeat(np.arange(5), 200)
    cells = PublishedCells.from_codes(columns, domains, [a, s])
    estimate = DecoyReconstruction(cells, 5, ["s"]).estimate(Query({"a": ("x",)}, {"s": "a"}))
    assert not estimate.identifiable
    assert estimate.estimate == pytest.approx(500 * 200 / 1000)
    assert (estimate.low, estimate.high) == (0.0, 500.0)


def test_a_value_in_every_group_leaves_no_conjunction_identifiable():
    """s0 at N/γ sits in every group: its records publish exactly as an average record of
    the other values, so no "P ∧ s" is identifiable, s0 or not (the 2×2 model answers
    the others)."""
    columns, domains = ["a", "s"], {"a": ["x", "y"], "s": [f"s{i}" for i in range(8)]}
    s = np.repeat(np.arange(8), [400, 300, 300, 250, 250, 200, 150, 150])  # 400 = 2000/5
    a = np.tile([0, 1], 1000)
    cells = PublishedCells.from_codes(columns, domains, [a, s])
    query = Query({"a": ("x",)}, {"s": "s3"})
    assert not DecoyReconstruction(cells, 5, ["s"]).estimate(query).identifiable
    assert DecoyReconstruction(cells, 5, ["s"], matrix="corrected").estimate(query).identifiable


def test_an_interval_wider_than_the_feasible_range_is_declined():
    """A value at 19% of the rows with γ = 5 (its estimate amplified about 80 times):
    its conjunction with a 5% predicate would have an interval far wider than |P|, so
    it is declined: the proportional share, in [0, |P|]. The rarest value is answered."""
    shares = [0.19, 0.15, 0.14, 0.12, 0.11, 0.1, 0.09, 0.06, 0.04]
    table = synthetic_table(shares, 45_000, public_values=20, seed=12)
    cells = PublishedCells.from_table(publish(table, seed=13))
    reconstruction = DecoyReconstruction(cells, 5, ["s"])
    rare = Query({"a": ("a7",)}, {"s": "s0"})
    declined = reconstruction.estimate(rare)
    rows = declined.predicate_rows
    assert not declined.identifiable and rows < 0.1 * len(table)
    assert (declined.low, declined.high) == (0.0, float(rows))
    share = (cells.column["s"] == cells.code("s", "s0")) @ cells.weights / cells.total
    assert declined.estimate == pytest.approx(rows * share)
    assert reconstruction.estimate(Query({"a": ("a7",)}, {"s": "s8"})).identifiable


def test_public_only_query_is_exact():
    table = synthetic_table(SHARES, 2000, seed=10)
    published = publish(table, seed=11)
    cells = PublishedCells.from_table(published)
    estimate = DecoyReconstruction(cells, 5, ["s"]).estimate(Query({"a": ("a1",)}, {}))
    exact = int((published.codes["a"] == 1).sum())
    assert (estimate.estimate, estimate.low, estimate.high) == (exact, exact, exact)


def test_cells_from_csv_rows_match_cells_from_the_table(tmp_path):
    import io

    from service.core.table import read_rows

    table = synthetic_table(SHARES, 1500, seed=12)
    text = io.StringIO()
    write_table(table, text)
    text.seek(0)
    raw = read_rows(text)
    from_rows = PublishedCells.from_rows(raw.header, raw.rows)
    from_table = PublishedCells.from_table(table)
    query = Query({"a": ("a0", "a2")}, {"s": "s3"})
    assert DecoyReconstruction(from_rows, 5, ["s"]).estimate(query) == DecoyReconstruction(
        from_table, 5, ["s"]
    ).estimate(query)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([1, 2], "a query is an object"),
        ({"where": {}, "values": {}}, "unknown query key 'values'"),
        ({"where": []}, "must be objects"),
        ({"where": {"a": []}}, "list of values is empty"),
        ({"where": {"a": 1.5}}, "values are strings"),
    ],
)
def test_malformed_queries_are_explained(obj, message):
    with pytest.raises(QueryError, match=message):
        Query.from_json(obj)


def test_queries_naming_the_wrong_columns_are_explained():
    cells = PublishedCells.from_table(synthetic_table(SHARES, 500, seed=13))
    reconstruction = DecoyReconstruction(cells, 5, ["s"])
    with pytest.raises(QueryError, match="'s' is sensitive"):
        reconstruction.check(Query({"s": ("s1",)}, {}))
    with pytest.raises(QueryError, match="no such public column"):
        reconstruction.check(Query({"zip": ("1",)}, {}))
    with pytest.raises(QueryError, match="not a sensitive column"):
        reconstruction.check(Query({}, {"a": "a1"}))
    with pytest.raises(ValueError, match="sensitive column 'x' is not in the published data"):
        DecoyReconstruction(cells, 5, ["x"])
