"""tools/fit_sp_rule.py: cuda_sp's small-n tile rule and the Hopper boundary read from the small-n tables."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools"))

import fit_sp_rule  # noqa: E402
from kernelplan.kernels import sparse24_sp  # noqa: E402
from kernelplan.kernels.sparse24_sp import sp_candidates, sp_config  # noqa: E402
from kernelplan.kernels.sparse24_ws_rule import ws_config  # noqa: E402

RESULTS = pathlib.Path(__file__).parents[1] / "bench" / "results"
TABLES = [RESULTS / f"sparse24-small-n-{gpu}.json" for gpu in ("h100", "h200")]
SPLIT_TABLE = RESULTS / "sparse24-small-n-split-wm-h200.json"
SMS = 132


def _row(n, m, k, sp_ms: dict, ws_ms: float, rule="cuda_ws", ws_rule=None):
    """A table row; its cuda_ws tile today's pick unless ``ws_rule`` names another."""
    ws_rule = ws_rule or str(ws_config(n, m, k, SMS))
    return {"n": n, "m": m, "k": k, "rule": rule, "ws_rule": ws_rule, "sp_rule": str(sp_config(n, m, k, SMS)),
            "tiles_ms": {**{str(c): t for c, t in sp_ms.items()}, ws_rule: ws_ms}}


def test_rule_ratios_count_the_rows_where_the_tile_matters_and_read_the_rules_pick():
    n, m, k = 8, 3584, 14336
    pick, other = sp_config(n, m, k, SMS), next(c for c in sp_candidates(n, m, k, SMS) if c != sp_config(n, m, k, SMS))
    rows = [_row(n, m, k, {pick: 1.2, other: 1.0}, ws_ms=2.0),  # cuda_sp's best beats cuda_ws: counted
            _row(n, m, k, {pick: 1.0, other: 1.0}, ws_ms=1.0)]  # cuda_ws as fast: the tile does not matter
    got = fit_sp_rule.rule_ratios(rows, SMS, sparse24_sp.SMALL_N_CTAS_PER_SM, sparse24_sp.SMALL_N_WARPS_PER_SM)
    assert got == [pytest.approx(1.2)]
    before = sparse24_sp.SMALL_N_WARPS_PER_SM
    fit_sp_rule.rule_ratios(rows, SMS, 1, 8)
    assert sparse24_sp.SMALL_N_WARPS_PER_SM == before  # the rule's settings are put back


def test_boundary_compares_todays_choice_with_the_faster_rule_and_the_tables_own():
    n, m, k = 8, 4096, 14336  # a wide weight of few rows: cuda_sp's at n <= 8 today
    rows = [_row(n, m, k, {sp_config(n, m, k, SMS): 1.0}, ws_ms=1.25)]
    assert fit_sp_rule.boundary(rows, SMS) == (pytest.approx(1.0), pytest.approx(0.8))  # the table ran cuda_ws


def test_boundary_reads_todays_cuda_ws_pick_and_skips_the_rows_that_did_not_time_it():
    n, m, k = 8, 3072, 8192  # cuda_ws's K split since docs/design/0061; the tables ran cuda_sp
    timed, untimed = (_row(n, m, k, {sp_config(n, m, k, SMS): 1.0}, 1.25, rule="cuda_sp", ws_rule="WsConfig(then)")
                      for _ in range(2))
    timed["tiles_ms"][str(ws_config(n, m, k, SMS))] = 0.8
    assert fit_sp_rule.boundary([timed, untimed], SMS) == (pytest.approx(1.0), pytest.approx(0.8))


def test_slice_moves_time_the_dividing_pick_against_todays_where_both_were_timed():
    n, m, k = 8, 4096, 1600  # 25 steps: 8 slices of 3 and 4 today, one in the tables' space
    today = sp_config(n, m, k, SMS)
    with fit_sp_rule.timed_space():
        before = sp_config(n, m, k, SMS)
    assert (today.k_warps, before.k_warps) == (8, 1)
    assert sparse24_sp.sp_config(n, m, k, SMS) == today  # the rule is put back
    rows = [_row(n, m, k, {today: 1.0, before: 1.3}, ws_ms=2.0), _row(n, m, k, {before: 1.3}, ws_ms=2.0),
            _row(8, 3584, 14336, {sp_config(8, 3584, 14336, SMS): 1.0}, ws_ms=2.0)]  # 224 steps: nothing moves
    assert fit_sp_rule.slice_moves(rows, SMS) == [(n, m, k, pytest.approx(1.3))]
    assert "1 picks moved" in fit_sp_rule.slice_report(rows, SMS)[0] and fit_sp_rule.slice_report(rows[1:], SMS) == []


def test_report_reads_a_table_where_cuda_sp_never_matters(tmp_path):
    n, m, k = 8, 4096, 1600
    with fit_sp_rule.timed_space():
        before = sp_config(n, m, k, SMS)
    rows = [_row(n, m, k, {sp_config(n, m, k, SMS): 2.0, before: 3.0}, ws_ms=1.0)]  # cuda_ws twice as fast
    table = tmp_path / "small-n.json"
    table.write_text(json.dumps({"rows": rows, "meta": {"sms": SMS, "device": "H200", "commit": "abc"}}))
    lines = fit_sp_rule.report(str(table))
    assert sum("no rows where" in line for line in lines) == 1 and not any("warps an SM:" in line for line in lines)
    assert "1 picks moved" in lines[-2] and lines[-1].endswith("1.500")


@pytest.mark.skipif(not all(t.exists() for t in TABLES), reason="the committed small-n tables")
def test_todays_small_n_rule_is_the_best_setting_of_the_grid_over_both_committed_tables():
    tables = [json.loads(t.read_text()) for t in TABLES]

    def mean(ctas, warps):
        return sum(fit_sp_rule.geomean(fit_sp_rule.rule_ratios(t["rows"], t["meta"]["sms"], ctas, warps))
                   for t in tables) / len(tables)

    today = mean(sparse24_sp.SMALL_N_CTAS_PER_SM, sparse24_sp.SMALL_N_WARPS_PER_SM)
    assert today == pytest.approx(min(mean(c, w) for c in fit_sp_rule.CTAS_PER_SM for w in fit_sp_rule.WARPS_PER_SM))
    assert today < 1.025  # within 2.5% of the best tile timed, where the tile matters (docs/design/0042)
    for t in tables:  # today's boundary takes less time than the one each table was made under (0.989, 0.990)
        assert fit_sp_rule.boundary(t["rows"], t["meta"]["sms"])[1] < 1
    lines = fit_sp_rule.report(str(TABLES[0]))
    assert sum("<- today" in line for line in lines) == 1 and "today's boundary" in lines[-1]


@pytest.mark.skipif(not SPLIT_TABLE.exists(), reason="the committed table of the small-n K-split tiles")
def test_todays_boundary_beats_the_one_before_the_k_split_tiles_on_the_table_that_timed_them():
    """sparse24-small-n-split-wm-h200.json (fa624d0) timed today's cuda_ws picks at n <= 16 over the sweep set: with
    the wide weights of 2049-3840 rows on cuda_ws at n <= 8, the rows take 0.995 of the time of the rule they were
    timed under (docs/design/0061)."""
    table = json.loads(SPLIT_TABLE.read_text())
    assert fit_sp_rule.boundary(table["rows"], table["meta"]["sms"])[1] < 1


def test_a_pick_is_read_at_its_own_ring_else_at_the_one_its_tile_was_timed_at():
    pick = sp_config(1, 4096, 4096, SMS)
    other_ring = sparse24_sp.SpConfig(pick.n_tiles, pick.row_tiles, pick.m_warps, pick.k_warps, stages=2)
    assert fit_sp_rule._timed({str(pick): 1.0, str(other_ring): 2.0}, pick) == 1.0
    assert fit_sp_rule._timed({str(other_ring): 2.0}, pick) == 2.0
    with pytest.raises(KeyError):  # neither its ring nor a single other one of its tile
        fit_sp_rule._timed({str(other_ring): 2.0, str(dataclasses.replace(other_ring, stages=3)): 3.0}, pick)
    with pytest.raises(KeyError):
        fit_sp_rule._timed({}, pick)
