"""Intervals and tests over seeds and over test items: Student's t intervals, the smallest difference a number of
paired seeds detects, paired gains item by item with McNemar's exact test, and Holm's correction (scipy's
distributions and tests throughout)."""

from __future__ import annotations

import math
import statistics

from scipy import optimize, stats


def t_quantile(probability: float, df: int) -> float:
    """The `probability` quantile of Student's t with `df` degrees of freedom (0.975, 2 -> 4.303)."""
    if df < 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}.")
    return float(stats.t.ppf(probability, df))


def t_interval(values: list[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean and two-sided t-interval of `values`, with their standard deviation and the interval's half-width
    (one value: no interval, `low`, `high`, `sd` and `half_width` are NaN)."""
    mean = statistics.fmean(values)
    if len(values) < 2 or math.isnan(mean):  # one value, or an endpoint some cell lacks
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": len(values), "sd": math.nan,
                "half_width": math.nan}
    sd = statistics.stdev(values)
    half = t_quantile(0.5 + confidence / 2, len(values) - 1) * sd / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values), "sd": sd, "half_width": half}


def minimum_detectable(sd: float, n: int, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true mean difference that a two-sided one-sample t-test of `n` paired differences with standard
    deviation `sd` detects at level 1 − `confidence` with probability `power` (exact, by the noncentral t); NaN
    without a spread (fewer than 2 values, or `sd` 0)."""
    if n < 2 or not sd > 0:
        return math.nan
    df, critical = n - 1, t_quantile(0.5 + confidence / 2, n - 1)

    def shortfall(delta: float) -> float:
        shift = delta * math.sqrt(n) / sd
        # The wrong-sign tail is negligible where scipy's noncentral t returns NaN for it (large shifts).
        wrong_sign = float(stats.nct.cdf(-critical, df, shift))
        return float(stats.nct.sf(critical, df, shift)) + (0.0 if math.isnan(wrong_sign) else wrong_sign) - power

    high = sd
    while shortfall(high) < 0:
        high *= 2
    return float(optimize.brentq(shortfall, 0.0, high, xtol=1e-10))


def paired_gain(base: list[float], final: list[float], confidence: float = 0.95) -> dict:
    """The gain of `final` over `base`, per-item scores of the same test items in the same order, in points: the
    mean difference with its two-sided t-interval, the paired t-test's p-value, and for binary scores McNemar's exact
    test (two-sided binomial test of the items that went right against those that went wrong; None otherwise).
    `passed`: the interval lies above 0 and McNemar's p (where there is one) is below 1 − `confidence`."""
    if len(base) != len(final) or len(base) < 2:
        raise ValueError(
            f"A paired test needs the same items, at least 2, in both evaluations: got {len(base)} "
            f"base and {len(final)} final scores."
        )
    differences = [100 * (after - before) for before, after in zip(base, final)]
    interval = t_interval(differences, confidence)
    if interval["sd"] > 0:
        p_value = float(stats.ttest_rel(final, base).pvalue)
    else:  # every item moved by the same amount: no spread, and a t-test is undefined
        p_value = 1.0 if interval["mean"] == 0 else 0.0
    improved = sum(after > before for before, after in zip(base, final))
    worsened = sum(after < before for before, after in zip(base, final))
    binary = all(value in (0.0, 1.0) for value in (*base, *final))
    mcnemar = None
    if binary:
        mcnemar = float(stats.binomtest(improved, improved + worsened, 0.5).pvalue) if improved + worsened else 1.0
    passed = interval["low"] > 0 and (mcnemar is None or mcnemar < 1 - confidence)
    return {
        "items": len(base),
        "base": 100 * statistics.fmean(base),
        "final": 100 * statistics.fmean(final),
        "gain": interval["mean"],
        "low": interval["low"],
        "high": interval["high"],
        "p_value": p_value,
        "improved": improved,
        "worsened": worsened,
        "mcnemar_p": mcnemar,
        "passed": passed,
    }


def paired_p(differences: list[float]) -> float:
    """The two-sided p-value of a paired t-test that the differences' mean is 0 (scipy's `ttest_1samp`); NaN with
    fewer than 2 differences or none of them apart."""
    if len(differences) < 2 or any(math.isnan(value) for value in differences) or min(differences) == max(differences):
        return math.nan  # too few, an endpoint some cell lacks, or no spread
    return float(stats.ttest_1samp(differences, 0.0).pvalue)


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (Holm 1979): the k-th smallest of m times (m − k + 1), kept monotone;
    NaN stays NaN and is not counted in m."""
    order = sorted((p, name) for name, p in p_values.items() if not math.isnan(p))
    adjusted, running = {}, 0.0
    for rank, (p, name) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p))
        adjusted[name] = running
    return {name: adjusted.get(name, math.nan) for name in p_values}

def seeds_for(sd: float, half_width: float, confidence: float = 0.95, limit: int = 1000) -> int | None:
    """The fewest paired seeds whose 95% t-interval is at most ±`half_width` at the spread `sd` (None without a
    spread, or beyond `limit`)."""
    if not sd > 0:
        return None
    for n in range(2, limit + 1):
        if t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n) <= half_width:
            return n
    return None


def paired(differences: list[float]) -> dict[str, float]:
    """The t-interval of paired differences and the two-sided p-value of their mean being 0 (`paired_p`: none where
    the differences do not spread, as identical differences over 2 seeds: a t-test cannot read them)."""
    return {**t_interval(differences), "p": paired_p(differences)}


def paired_endpoints(pairs: list[tuple[dict, dict]], endpoints: list[str], primary: str) -> dict[str, dict]:
    """Each endpoint's `paired` differences ours − theirs over `pairs` (one (ours, theirs) of endpoint values per
    seed), and for the secondary endpoints (all but `primary`) their Holm-adjusted p-value, "p_holm"."""
    rows = {name: paired([ours[name] - theirs[name] for ours, theirs in pairs]) for name in endpoints}
    for name, adjusted in holm({name: rows[name]["p"] for name in endpoints if name != primary}).items():
        rows[name]["p_holm"] = adjusted
    return rows


def p_text(value: float | None) -> str:
    """A p-value as the reports print it: two significant digits, "< 1e-4" below that, "—" for none."""
    if value is None:
        return "—"
    return f"{value:.2g}" if value >= 1e-4 else "< 1e-4"
