"""tools/fit_ws_rule.py --report: the rule's misses and the multicast pairs, on a hand-made tile table."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools"))

import fit_ws_rule  # noqa: E402
from kernelplan.kernels.sparse24_ws_rule import (WEIGHTS, WsConfig, gated_tile, rule_order,  # noqa: E402
                                                ws_candidates, ws_config)

SMS = 132


def _row(n, m, k, times):
    return {"m": m, "k": k, "n": n, "dense_ms": 1.0, "tiles_ms": {str(c): t for c, t in times.items()}, "wrong": {}}


def _table(tmp_path, rows):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"meta": {"sms": SMS}, "rows": rows}))
    return fit_ws_rule.problems(str(path))


def test_report_gives_the_rules_misses_by_n_and_the_multicast_pairs(tmp_path):
    n, m, k = 256, 4096, 4096
    pick = ws_config(n, m, k, SMS)
    mcast = next(c for c in ws_candidates(n, m, k) if c.kc == 1 and c.cm == 2 and c != pick)
    uni = dataclasses.replace(mcast, cm=1)
    # The rule's pick takes 1.2, the best 1.0; the multicast tile 1.5 against its cm = 1 sibling's 1.25.
    rows = [_row(n, m, k, {pick: 1.2, uni: 1.25, mcast: 1.5, **{c: 1.0 for c in ws_candidates(n, m, k)[-1:]}}),
            _row(512, m, k, {ws_config(512, m, k, SMS): 1.0, ws_candidates(512, m, k)[-1]: 1.02})]
    lines = fit_ws_rule.report(WEIGHTS, _table(tmp_path, rows))
    assert lines[1] == "256 | 1.200 | 1.200 | 1"
    assert lines[2] == "512 | 1.000 | 1.000 | 0"  # the pick is the best there
    assert lines[3] == f"miss 1.200: {m}x{k} n = {n}"
    assert lines[-2] == "x multicast, kc = 1: 1 pairs, the tile without it faster in 100%, multicast's time over it " \
                        "median 1.200"
    assert lines[-1] == "  cm = 2, grids of 0-2 waves: 1 pairs, median 1.200, min 1.200, max 1.200"  # 256 CTAs


def test_report_leaves_out_the_pairs_where_the_table_timed_no_multicast_tile(tmp_path):
    n, m, k = 256, 4096, 4096
    lines = fit_ws_rule.report(WEIGHTS, _table(tmp_path, [_row(n, m, k, {ws_config(n, m, k, SMS): 1.0})]))
    assert lines == ["n | mean | max | over 5%", "256 | 1.000 | 1.000 | 0", f"miss 1.000: {m}x{k} n = {n}"]


def test_problems_read_the_cuda_ws_tiles_of_a_small_n_tables_rows(tmp_path):
    """A small-n table (bench/sparse24_small_n.py) times cuda_sp's tiles beside cuda_ws's: the rule is scored against
    the best cuda_ws tile, and a row of cuda_sp's tiles alone says nothing about it."""
    n, m, k = 8, 3072, 3072
    pick, other = ws_config(n, m, k, SMS), next(c for c in ws_candidates(n, m, k) if c != ws_config(n, m, k, SMS))
    rows = [{"m": m, "k": k, "n": n, "tiles_ms": {"SpConfig(a)": 0.5, str(pick): 1.0, str(other): 1.25}},
            {"m": m, "k": k, "n": 1, "tiles_ms": {"SpConfig(a)": 0.5}}]
    table = _table(tmp_path, rows)
    assert len(table) == 1 and fit_ws_rule.ratios(WEIGHTS, table) == [1.0]


def test_report_runs_from_the_command_line(tmp_path, capsys):
    n, m, k = 128, 3072, 3072
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"meta": {"sms": SMS}, "rows": [_row(n, m, k, {ws_config(n, m, k, SMS): 2.0})]}))
    assert fit_ws_rule.main([str(path), "--report"]) == 0
    out = capsys.readouterr().out
    assert "(1 problems)" in out and "128 | 1.000 | 1.000 | 0" in out


@pytest.mark.parametrize("n", [128, 2048])
def test_report_at_the_present_weights_agrees_with_ratios(tmp_path, n):
    m, k = 8192, 8192
    pick = ws_config(n, m, k, SMS)
    cands = [c for c in ws_candidates(n, m, k) if c != pick][:3] + [pick]  # the pick timed, and the slowest
    table = _table(tmp_path, [_row(n, m, k, {c: 1.0 + 0.1 * i for i, c in enumerate(cands)})])
    r = fit_ws_rule.ratios(WEIGHTS, table)
    assert fit_ws_rule.report(WEIGHTS, table)[1] == f"{n} | {1 / r[0]:.3f} | {1 / r[0]:.3f} | {int(1 / r[0] > 1.05)}"


def _fitted(path, capsys, *args):
    """The weights ``fit_ws_rule`` prints last, fitted to the table at ``path``."""
    assert fit_ws_rule.main([str(path), *args]) == 0
    return eval(capsys.readouterr().out.strip().splitlines()[-1], {"RuleWeights": type(WEIGHTS)})


def _fit(tmp_path, capsys, *args):
    n, m, k = 128, 3584, 3584
    # The rule's pick is slow and every other tile fast: the search has a reason to move a weight (step does it).
    times = {c: (2.0 if c == ws_config(n, m, k, SMS) else 1.0) for c in ws_candidates(n, m, k)}
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"meta": {"sms": SMS}, "rows": [_row(n, m, k, times)]}))
    return _fitted(path, capsys, *args)


def test_field_restricts_the_search_to_the_weights_named(tmp_path, capsys):
    assert _fit(tmp_path, capsys).step != WEIGHTS.step  # unrestricted, the search moves step
    fitted = _fit(tmp_path, capsys, "--field", "step")
    assert fitted.step != WEIGHTS.step and dataclasses.replace(fitted, step=WEIGHTS.step) == WEIGHTS
    assert _fit(tmp_path, capsys, "--field", "copy") == WEIGHTS  # copy alone cannot move the pick here


def test_a_pick_the_table_did_not_time_is_untimed_not_the_best_of_the_rest(tmp_path):
    n, m, k = 256, 4096, 4096
    others = [c for c in ws_candidates(n, m, k) if c != ws_config(n, m, k, SMS)][:2]
    table = _table(tmp_path, [_row(n, m, k, {others[0]: 1.0, others[1]: 1.3}),
                              _row(512, m, k, {ws_config(512, m, k, SMS): 1.0})])
    assert fit_ws_rule.ratios(WEIGHTS, table) == [None, 1.0]
    assert fit_ws_rule.report(WEIGHTS, table)[:3] == ["untimed picks: 1 of 2", "n | mean | max | over 5%",
                                                      "512 | 1.000 | 1.000 | 0"]


def test_the_search_never_moves_a_pick_onto_a_tile_no_table_timed(tmp_path, capsys):
    # The rule's pick is slow and one other tile fast; every other tile untimed.  Moving off the pick is a gain
    # only if the new pick is that one tile: landing anywhere else is a guess the search must not take.
    n, m, k = 128, 3584, 3584
    pick = ws_config(n, m, k, SMS)
    path = tmp_path / "tiles.json"
    for other in [c for c in ws_candidates(n, m, k) if c != pick][:6]:
        path.write_text(json.dumps({"meta": {"sms": SMS}, "rows": [_row(n, m, k, {pick: 2.0, other: 1.0})]}))
        fitted = _fitted(path, capsys)
        assert fit_ws_rule.ratios(fitted, fit_ws_rule.problems(str(path))) != [None]


def test_a_tuning_benchs_untuned_and_cuda_sp_rows_are_left_out(tmp_path):
    from kernelplan.kernels.sparse24_sp import sp_config

    n, m, k = 256, 4096, 4096
    rows = [_row(n, m, k, {ws_config(n, m, k, SMS): 1.0}),
            {"m": 1024, "k": 200, "n": 8, "rule": "None", "tile": "None", "tiles_ms": None},  # the Triton kernel's
            {"m": 9216, "k": 4096, "n": 8, "backend": "cuda_sp", "tiles_ms": {str(sp_config(8, 9216, 4096, SMS)): 1.0}}]
    assert [p[:3] for p in _table(tmp_path, rows)] == [(n, m, k)]


def test_hold_keeps_the_picks_at_the_n_no_table_timed(tmp_path, capsys):
    """``--hold N``: the sweep set's picks at N count as untimed once moved, so the search leaves them; here the one
    problem the table gives is at such an n, and unheld the search moves its pick."""
    from kernelplan.bench.sweep import sweep_shapes

    held = fit_ws_rule.held([128])
    assert len(held) == len(sweep_shapes()) and all(sum(t is not None for t in p[5]) == 1 for p in held)

    def picks(w):
        return [min(ws_candidates(128, m, k), key=lambda c: rule_order(c, 128, m, k, SMS, w))
                for m, k in sweep_shapes()]

    assert picks(_fit(tmp_path, capsys)) != picks(WEIGHTS)
    assert picks(_fit(tmp_path, capsys, "--hold", "128", "4096")) == picks(WEIGHTS)


def test_the_rules_picks_drop_multicast_in_grids_of_two_waves_and_the_fit_scores_that_tile(tmp_path):
    """The rule (rule_pick, docs/design/0054) moves a least-cost tile that multicasts x without a K split in a grid
    of at most 2 waves to its cm = 1 sibling, and fit_ws_rule scores the tile the rule runs."""
    n, m, k = 256, 32064, 3072
    least = min(ws_candidates(n, m, k), key=lambda c: rule_order(c, n, m, k, SMS))
    assert least.cm == 2 and least.kc == 1
    tiles_n, blocks, slices = least.grid(n, m)
    assert 132 < tiles_n * blocks * slices <= 264  # 251 CTAs: 1.9 waves
    uni = dataclasses.replace(least, cm=1)
    assert ws_config(n, m, k, SMS) == uni
    table = _table(tmp_path, [_row(n, m, k, {least: 1.0, uni: 1.1})])
    assert fit_ws_rule.ratios(WEIGHTS, table) == [pytest.approx(1 / 1.1)]


def test_unicast_moves_only_the_multicast_picks_of_the_grids_and_cluster_sizes_asked(tmp_path):
    """--unicast-waves / --unicast-cm (docs/design/0053): a pick that still multicasts x without a K split (a grid
    of more than 2 waves) moves to its cm = 1 sibling only where its grid is at most that many waves and its cluster
    that size."""
    n, m, k = 2048, 6144, 4096
    pick = ws_config(n, m, k, SMS)
    assert pick.cm == 2 and pick.kc == 1
    tiles_n, blocks, slices = pick.grid(n, m)
    assert tiles_n * blocks * slices == 384  # 2.9 waves
    table = _table(tmp_path, [_row(n, m, k, {pick: 1.1, dataclasses.replace(pick, cm=1): 1.0})])
    assert fit_ws_rule.ratios(WEIGHTS, table) == [pytest.approx(1 / 1.1)]
    assert fit_ws_rule.ratios(WEIGHTS, table, unicast=True) == [1.0]
    assert fit_ws_rule.ratios(WEIGHTS, table, unicast=True, waves=3) == [1.0]
    assert fit_ws_rule.ratios(WEIGHTS, table, unicast=True, waves=2.5) == [pytest.approx(1 / 1.1)]
    assert fit_ws_rule.ratios(WEIGHTS, table, unicast=True, cms=(4,)) == [pytest.approx(1 / 1.1)]


def test_the_tile_benchs_unicast_pairs_are_the_moved_picks_and_their_siblings():
    """bench/sparse24_wg_tiles.py --unicast-pairs W times, per problem, the pick that --unicast-waves W would move
    and the tile it would move to, and nothing where the pick stays."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_wg_tiles

    for gated in (False, True):
        n, m, k = 256, 32064, 3072  # the least-cost tile multicasts x in a grid of 1.9 waves; the rule runs cm = 1
        pick = ws_config(n, m, k, SMS, gated)
        assert pick.cm == 1 and (not gated or gated_tile(pick))
        least = dataclasses.replace(pick, cm=2)
        assert sparse24_wg_tiles._unicast_pair(2, SMS, gated, n, m, k) == [least, pick]
        assert pick in ws_candidates(n, m, k)  # a tile of the rule's space: fit_ws_rule finds it
        assert sparse24_wg_tiles._unicast_pair(1.5, SMS, gated, n, m, k) == []
        assert ws_config(1, 4096, 4096, SMS).cm == 1 and sparse24_wg_tiles._unicast_pair(2, SMS, gated, 1, 4096,
                                                                                         4096) == []


def test_the_rule_ab_bench_times_exactly_the_picks_another_multicast_threshold_moves():
    """bench/sparse24_rule_ab.py (docs/design/0055): the other rule's tile is the rule's with x multicast past W
    waves, the rule itself is left as it was, and the problems timed are those whose two tiles differ."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab
    from kernelplan.kernels import sparse24_ws, sparse24_ws_rule

    n, m, k = 1024, 28672, 4096  # x shared by 2 CTAs in a grid of 896 CTAs, 6.8 waves of 132
    here = ws_config(n, m, k, SMS)
    assert here.cm == 2 and here.kc == 1
    assert sparse24_rule_ab.other_pick(n, m, k, SMS, 16) == dataclasses.replace(here, cm=1)
    assert sparse24_rule_ab.other_pick(n, m, k, SMS, 6) == here  # more than 6 waves: multicast stays
    assert sparse24_ws_rule.MULTICAST_MIN_WAVES == 2 and ws_config(n, m, k, SMS) == here
    shapes = [(28672, 4096), (768, 768), (3072, 3072)]
    got = sparse24_rule_ab.moved(shapes, [128, 1024, 2048], SMS, 16)
    assert (n, m, k) in got and all(sparse24_rule_ab.other_pick(*p, SMS, 16) != ws_config(*p, SMS) for p in got)
    assert all(sparse24_rule_ab.other_pick(nn, mm, kk, SMS, 16) == ws_config(nn, mm, kk, SMS)
               for mm, kk in shapes for nn in (128, 1024, 2048) if (nn, mm, kk) not in got)
    assert sparse24_rule_ab.FixedTile(here).config(1, 64, 64, 0) == here
    # A weight keeps its launches by the kernel's name: each tile's own, not the first tile a weight was called with.
    from kernelplan.kernels.sparse24_mma import MmaLinear

    other = dataclasses.replace(here, cm=1)
    keys = {MmaLinear(None, sparse24_rule_ab.FixedTile(c))._key for c in (here, other)}
    assert len(keys) == 2 and MmaLinear(None, sparse24_ws.WsKernel())._key not in keys


def test_the_rule_ab_bench_times_the_picks_other_weights_move():
    """bench/sparse24_rule_ab.py --weights (docs/design/0056): the other rule is ws_config under the weights given,
    the rest of WEIGHTS as they are; a bad setting names itself and the fields."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab
    from kernelplan.bench.shapes import sweep_shapes
    from kernelplan.kernels import sparse24_ws_rule

    other = sparse24_rule_ab.weights_of(["l2=0.007", "pp_tile=5550"])
    assert other == dataclasses.replace(WEIGHTS, l2=0.007, pp_tile=5550.0)
    for bad in (["l2"], ["nope=1"]):
        with pytest.raises(SystemExit, match="FIELD=VALUE with FIELD one of"):
            sparse24_rule_ab.weights_of(bad)
    shapes = list(sweep_shapes())
    got = sparse24_rule_ab.moved(shapes, [512, 1024], SMS, sparse24_ws_rule.MULTICAST_MIN_WAVES, other)
    assert got
    for n, m, k in got:  # the library's rule under those weights, and not the rule's tile
        want = ws_config(n, m, k, SMS, w=other)
        assert sparse24_rule_ab.other_pick(n, m, k, SMS, sparse24_ws_rule.MULTICAST_MIN_WAVES, other) == want
        assert want != ws_config(n, m, k, SMS)
    assert len(got) < len(shapes) * 2
    assert sparse24_rule_ab.moved(shapes, [512, 1024], SMS, sparse24_ws_rule.MULTICAST_MIN_WAVES, WEIGHTS) == []


def test_the_rule_ab_bench_times_uneven_k_splits_against_the_rule_before_them(monkeypatch, capsys):
    """bench/sparse24_rule_ab.py --even-k-split --shapes (docs/design/0058): the other rule's pick is among K splits
    that divide K's steps (the pick before uneven slices); where K's steps divide, the two agree."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab
    from kernelplan.kernels import sparse24_ws_rule

    waves = sparse24_ws_rule.MULTICAST_MIN_WAVES
    assert ws_config(32, 1600, 1600, SMS).kc == 4  # 25 steps: 6, 6, 6 and 7
    assert sparse24_rule_ab.other_pick(32, 1600, 1600, SMS, waves, even_split=True) == \
        WsConfig(bn=32, wm=1, cm=1, kc=1, stages=8, pp=True)  # the pick at 51935dc
    shapes = [(1024, 2880), (4096, 4096), (2048, 1600)]
    got = sparse24_rule_ab.moved(shapes, [1, 8, 16, 32, 64, 128], SMS, waves, WEIGHTS, even_split=True)
    # 25 steps at n <= 32: the K splits over 4 CTAs (at n <= 16 of 32 rows of x, docs/design/0061), at n = 64 over 2
    # (a grid of 32 CTAs split, 0074) and at n = 128 over 2 (the one-block K split, 0073); 64 steps at n <= 16: the
    # split over 3 (0063)
    assert got and all(k == 2880 or (k == 1600 and n in (1, 8, 16, 32, 64, 128)) or (k == 4096 and n <= 16)
                       for n, m, k in got)
    for n, m, k in got:
        other = sparse24_rule_ab.other_pick(n, m, k, SMS, waves, WEIGHTS, True)
        assert (k // 64) % other.kc == 0 and (k // 64) % ws_config(n, m, k, SMS).kc
    assert sparse24_rule_ab.moved(shapes, [1, 8, 16, 32, 64, 128], SMS, waves, WEIGHTS, even_split=False) == []
    with pytest.raises(SystemExit) as bad:  # before any CUDA
        with monkeypatch.context() as mp:
            mp.setattr(sys, "argv", ["sparse24_rule_ab.py", "--even-k-split", "--shapes", "2048,1600"])
            sparse24_rule_ab.main()
    assert bad.value.code == 2 and "--shapes takes layers as MxK" in capsys.readouterr().err


def test_the_rule_ab_bench_times_the_small_n_splits_against_the_rule_before_them():
    """bench/sparse24_rule_ab.py --wide-split-only (docs/design/0061): the other rule gives a wide weight the one-block
    K split at n <= 16 and every other weight the least-cost tile without the splits, so the two part only at n <= 16,
    on the weights whose pick today is a split of two blocks or that are no longer wide-only."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab
    from kernelplan.kernels import sparse24_ws_rule

    one, two = (WsConfig(32, wm, 1, 4, 8) for wm in (1, 2))
    assert sparse24_rule_ab.wide_split_pick(8, 3584, 18944, SMS) == one and ws_config(8, 3584, 18944, SMS) == two
    other = sparse24_rule_ab.wide_split_pick(8, 3072, 3072, SMS)  # not wide: the least cost without the splits
    assert other.bn == 16 and ws_config(8, 3072, 3072, SMS) == two
    assert sparse24_rule_ab.wide_split_pick(8, 768, 3072, SMS) == ws_config(8, 768, 3072, SMS) == one
    waves = sparse24_ws_rule.MULTICAST_MIN_WAVES
    got = sparse24_rule_ab.moved([(3072, 3072), (768, 3072), (8192, 3584)], [1, 8, 16, 32, 128], SMS, waves,
                                 wide_split_only=True)
    assert got == [(1, 3072, 3072), (8, 3072, 3072), (16, 3072, 3072)]


def test_the_rule_ab_bench_times_the_split_over_3_against_the_rule_before_it():
    """bench/sparse24_rule_ab.py --no-split3 (docs/design/0063): the other rule is the least-cost tile without the K
    split over 3 CTAs, so the two part only at n <= 16, where today's pick splits over 3."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab
    from kernelplan.kernels import sparse24_ws_rule

    waves = sparse24_ws_rule.MULTICAST_MIN_WAVES
    got = sparse24_rule_ab.moved([(4608, 3584), (4096, 4096), (3072, 3072)], [1, 8, 16, 32, 128], SMS, waves,
                                 no_split3=True)
    assert got == [(1, 4608, 3584), (8, 4608, 3584), (16, 4608, 3584)]
    for p in got:
        other = sparse24_rule_ab.other_pick(*p, SMS, waves, no_split3=True)
        assert ws_config(*p, SMS).kc == 3 and (other.kc, other.wm) == (2, 2)


def test_the_rule_ab_bench_times_the_small_grid_split_against_the_pick_by_cost():
    """bench/sparse24_rule_ab.py --no-small-grid-split (docs/design/0064): the other rule keeps the pick by cost, so the
    two part only at n <= 16 on grids under a quarter of the SMs."""
    moves = _rule_ab_moves([(1024, 1024), (2304, 768), (4608, 3584)], no_small_grid=True)
    assert list(moves) == [(1, 1024, 1024), (8, 1024, 1024), (16, 1024, 1024)]
    for p, other in moves.items():
        assert ws_config(*p, SMS).kc == 4 and (other.kc, other.pp) == (1, True)


def _rule_ab_moves(shapes, batch=(1, 8, 16, 32), **other_rule) -> dict:
    """bench/sparse24_rule_ab.py's problems at n of ``batch`` where the rule and ``other_rule`` part, each with the
    other rule's tile."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab
    from kernelplan.kernels import sparse24_ws_rule

    waves = sparse24_ws_rule.MULTICAST_MIN_WAVES
    got = sparse24_rule_ab.moved(shapes, list(batch), SMS, waves, **other_rule)
    return {p: sparse24_rule_ab.other_pick(*p, SMS, waves, **other_rule) for p in got}


def test_the_rule_ab_bench_times_the_deeper_ring_against_the_8_stage_one():
    """bench/sparse24_rule_ab.py --no-deep-ring (docs/design/0066): the other rule is the same tile at the 8 stages of
    its candidate, only where with_ring deepens it (n <= 16, few CTAs, long K slices)."""
    moves = _rule_ab_moves([(5120, 5120), (8192, 8192), (2048, 2048)], no_deep_ring=True)
    assert list(moves) == [(1, 5120, 5120), (8, 5120, 5120), (16, 5120, 5120)]
    for p, other in moves.items():
        assert ws_config(*p, SMS) == dataclasses.replace(other, stages=12) and other.stages == 8


def test_the_rule_ab_bench_times_the_rule_without_the_192_row_k_splits():
    """bench/sparse24_rule_ab.py --no-wide-k-splits (docs/design/0067): the other rule has no tile of 192 rows of W
    splitting K; the two part only where this rule takes one (K slices of 96 steps or more, past n = 16)."""
    from kernelplan.kernels.sparse24_ws_rule import wide_split

    moves = _rule_ab_moves([(5120, 27648), (5120, 5120), (3072, 8192)], batch=(16, 32, 256, 384), no_wide_splits=True)
    assert sorted(moves) == [(32, 5120, 27648), (256, 5120, 27648)]
    for p, other in moves.items():
        assert wide_split(ws_config(*p, SMS)) and not wide_split(other)


def test_the_rule_ab_bench_times_the_rule_without_the_one_x_twins():
    """bench/sparse24_rule_ab.py --no-one-x (docs/design/0068): the other rule keeps the K split of two blocks of W
    and 64 rows of x; the two part only where this rule takes the twin of one block and one tile of x."""
    moves = _rule_ab_moves([(4096, 4096), (8192, 8192), (768, 3072)], batch=(64, 120, 128, 256, 512), no_one_x=True)
    assert sorted(moves) == [(120, 4096, 4096), (128, 4096, 4096)]
    for p, other in moves.items():
        here = ws_config(*p, SMS)
        assert (here.bn, here.wm, other.bn, other.wm, here.kc) == (128, 1, 64, 2, other.kc)


def test_the_rule_ab_bench_times_the_rule_with_every_ping_pong_tie_to_ping_pong():
    """bench/sparse24_rule_ab.py --pp-ties (docs/design/0068): the other rule gives each tie between a ping-pong tile
    and the same tile one a CTA to the ping-pong one; the two part only at the 64 x 3 and 128 x 2 ties this rule gives
    the other way (0070)."""
    moves = _rule_ab_moves([(4096, 4096), (1024, 1024), (4608, 3584)], batch=(128, 256, 512, 2048), pp_ties=True)
    assert sorted(moves) == [(256, 4608, 3584), (512, 4096, 4096), (2048, 1024, 1024)]
    for n, m, k in ((512, 4096, 4096), (2048, 1024, 1024)):
        assert moves[(n, m, k)] == WsConfig(128, 2, 1, 1, 6, pp=True)
        assert ws_config(n, m, k, SMS) == WsConfig(128, 2, 1, 1, 8)
    assert moves[(256, 4608, 3584)] == WsConfig(64, 3, 1, 1, 7, pp=True)
    assert ws_config(256, 4608, 3584, SMS) == WsConfig(64, 3, 1, 1, 8)


def test_the_rule_ab_bench_times_the_rule_with_the_small_ping_pong_ties_to_the_one_a_cta_tile():
    """bench/sparse24_rule_ab.py --plain-ties (docs/design/0069): the other rule gives the ties of ping-pong tiles under
    64 x 3 to the same tile one a CTA too (this rule gives them to ping-pong); the two part only there, not at the
    64 x 3 and 128 x 2 ties this rule already gives the tile one a CTA (docs/design/0070)."""
    moves = _rule_ab_moves([(4096, 4096), (1024, 1024), (6144, 4096)], batch=(128, 256, 512, 2048), plain_ties=True)
    assert moves and (512, 4096, 4096) not in moves and (2048, 1024, 1024) not in moves
    # 1024x1024 at n = 128: this rule's ping-pong tile gives way to a narrow K split (0073), which needs one
    assert ws_config(128, 1024, 1024, SMS).kc == 2 and moves.pop((128, 1024, 1024)).kc == 1
    for (n, m, k), other in moves.items():
        here = ws_config(n, m, k, SMS)
        assert here.pp and here.bn * here.wm < 192, (n, m, k, here)
        assert other == WsConfig(here.bn, here.wm, 1, 1, other.stages) and not other.pp, (n, m, k, other)


def test_the_rule_ab_bench_times_the_ties_where_x_has_more_tiles_at_the_ping_pong_tile():
    """bench/sparse24_rule_ab.py --pp-wide-x-ties (docs/design/0070): the other rule is 0068's, which gave the ties
    where x has more tiles than W has blocks to the ping-pong tile at 64 x 3 and 128 x 2 too; the two part only
    there."""
    moves = _rule_ab_moves([(1024, 1024), (768, 768), (4096, 4096)], batch=(128, 512, 1024, 2048),
                           pp_wide_x_ties=True)
    assert sorted(moves) == [(2048, 768, 768), (2048, 1024, 1024)]
    for (n, m, k), other in moves.items():
        here = ws_config(n, m, k, SMS)
        tiles_n, blocks, _ = here.grid(n, m)
        assert not here.pp and here.bn * here.wm >= 192 and tiles_n > blocks, (n, m, k, here)
        assert other.pp and dataclasses.replace(other, stages=8, pp=False) == here, (n, m, k, other)


def test_the_rule_ab_bench_takes_one_other_side(monkeypatch, capsys):
    """--wide-split-only is another rule: with --table-misses too it is refused before any CUDA, and so is --plain-ties
    with --pp-ties or --pp-wide-x-ties."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab

    with pytest.raises(SystemExit) as bad:
        with monkeypatch.context() as mp:
            mp.setattr(sys, "argv", ["sparse24_rule_ab.py", "--wide-split-only", "--table-misses", "t.json"])
            sparse24_rule_ab.main()
    assert bad.value.code == 2 and "not both" in capsys.readouterr().err
    for other in ("--pp-ties", "--pp-wide-x-ties"):
        with pytest.raises(SystemExit) as bad:
            with monkeypatch.context() as mp:
                mp.setattr(sys, "argv", ["sparse24_rule_ab.py", other, "--plain-ties"])
                sparse24_rule_ab.main()
        assert bad.value.code == 2 and f"--plain-ties and {other} give" in capsys.readouterr().err


def test_the_rule_ab_bench_takes_a_tables_misses_against_their_best_tile(tmp_path):
    """bench/sparse24_rule_ab.py --table-misses (docs/design/0056): the problems where the table's best tile ran
    min_gain or more faster than the rule's own tile, timed in the same row, each against that best tile."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab

    rows, want = [], {}
    for (n, m, k), ratio in {(128, 3072, 3072): 1.10, (512, 4096, 4096): 1.02, (256, 768, 3072): 1.04}.items():
        rule = ws_config(n, m, k, SMS)
        other = next(c for c in ws_candidates(n, m, k) if c != rule)
        rows.append({"m": m, "k": k, "n": n, "tiles_ms": {str(rule): ratio, str(other): 1.0, "SpConfig(x)": 0.1}})
        if ratio >= 1.03:
            want[(n, m, k)] = other
    # A row whose rule tile the table did not time says nothing.
    rows.append({"m": 1024, "k": 1024, "n": 64, "tiles_ms": {str(WsConfig(16, 1)): 1.0}})
    (tmp_path / "t.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    assert sparse24_rule_ab.table_misses(str(tmp_path / "t.json"), SMS, 0.03) == want
    assert list(sparse24_rule_ab.table_misses(str(tmp_path / "t.json"), SMS, 0.05)) == [(128, 3072, 3072)]


def test_table_vs_sweep_compares_the_same_tile_on_the_same_problem_by_kind(tmp_path, capsys):
    """tools/table_vs_sweep.py (docs/design/0055): the sweep's speedup over the tile table's, where both timed one
    tile on one problem, grouped by kind of tile; tiles and problems only one of them timed say nothing."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools"))
    import table_vs_sweep

    n, m, k = 256, 4096, 4096
    split, mcast = [c for c in ws_candidates(n, m, k) if c.kc == 2][0], [c for c in ws_candidates(n, m, k)
                                                                         if c.cm == 2 and c.kc == 1][0]
    tables = tmp_path / "tiles.json"
    tables.write_text(json.dumps({"meta": {"sms": SMS}, "rows": [
        _row(n, m, k, {split: 0.5, mcast: 0.8}), _row(512, m, k, {split: 0.5})]}))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"rows": [
        {"m": m, "k": k, "n": n, "rule": "cuda_ws", "ws_config": str(split), "speedup": 2.2},
        {"m": m, "k": k, "n": 128, "rule": "cuda_ws", "ws_config": str(mcast), "speedup": 9.0},  # no table row
        {"m": m, "k": k, "n": 512, "rule": "cuda_sp", "speedup": 9.0}]}))  # not cuda_ws's
    got = table_vs_sweep.by_kind([str(tables)], [str(sweep)])
    assert got == {"K split": [pytest.approx(2.2 / 2.0)]}
    assert mcast.kind == "x multicast, K whole" and split.kind == "K split"
    assert WsConfig(64, 1, pp=True).kind == "ping-pong" and WsConfig(64, sk=True).kind == "split persistent"
    assert WsConfig(64).kind == "one CTA a tile"
    assert table_vs_sweep.main(["--tables", str(tables), "--sweeps", str(sweep)]) == 0
    assert "K split: 1 problems, the sweep's speedup over the table's: median 1.100" in capsys.readouterr().out


def test_the_fit_names_the_tables_timed_with_short_graphs(tmp_path, capsys):
    """docs/design/0056: tables without meta.timer were timed with short graphs, which read K-split tiles slow."""
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"meta": {"sms": SMS}, "rows": []}))
    new.write_text(json.dumps({"meta": {"sms": SMS, "timer": "graph_us, rep 10 ms"}, "rows": []}))
    assert fit_ws_rule.short_graph_tables([str(old), str(new)]) == [str(old)]
    fit_ws_rule.main([str(old), str(new), "--report"])
    err = capsys.readouterr().err
    assert str(old) in err and str(new) not in err and "short graphs" in err


def test_the_harness_ab_bench_times_the_rules_tile_and_one_of_each_other_kind():
    """bench/sparse24_harness_ab.py (docs/design/0055): per problem the rule's tile first, then the least-cost tile of
    each other kind; its summary divides each variant's speedup by the sweep's, per kind."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_harness_ab
    import sparse24_wg_tiles

    n, m, k = 512, 4096, 4096
    got = sparse24_harness_ab.tiles_of_each_kind(n, m, k, SMS)
    assert got[0] == ws_config(n, m, k, SMS) and len({c.kind for c in got}) == len(got) == 4
    for cfg in got[1:]:
        same = [c for c in ws_candidates(n, m, k) if c.kind == cfg.kind]
        assert cfg == min(same, key=lambda c: rule_order(c, n, m, k, SMS))
    assert sparse24_wg_tiles.weight_copies(4096, 4096) == 7 and sparse24_wg_tiles.weight_copies(768, 768) == 8
    assert sparse24_wg_tiles.weight_copies(28672, 8192) == 1
    # About 2 ms of work a graph at 2 PFLOP/s, 6 to 100 calls.
    assert [sparse24_wg_tiles.calls_per_graph(n, 4096, 4096) for n in (1, 16, 512)] == [100, 7, 6]
    rows = [{"kind": "K split", "speedup": {"sweep": 1.0, "lib-tilecopies": 1.1, "direct": 0.9,
                                            "direct-tilecopies": 0.8, "tile-bench": 0.7}},
            {"kind": "K split", "speedup": {"sweep": 2.0, "lib-tilecopies": 2.0, "direct": 2.0,
                                            "direct-tilecopies": 2.0, "tile-bench": 2.0}}]
    assert sparse24_harness_ab.summary(rows) == ["K split (2): over the sweep's reading: lib-tilecopies 1.050, "
                                                 "direct 0.950, direct-tilecopies 0.900, tile-bench 0.850"]
    # Each variant against dense timed its way, under its copies; a variant not timed is left out of the summary.
    assert [sparse24_harness_ab.dense_of(v) for v in ("sweep", "direct-tilecopies", "tile-bench", "tuner")] == \
        ["dense sweep graph_us", "dense tile graph_us", "dense tile tile-bench", "dense sweep tuner"]
    assert sparse24_harness_ab.summary([{"kind": "ping-pong", "speedup": {"sweep": 1.0, "tuner": 0.9}}]) == \
        ["ping-pong (1): over the sweep's reading: tuner 0.900"]
    assert set(sparse24_harness_ab.timers(512, 4096, 4096)) == {t for _, _, t in sparse24_harness_ab.VARIANTS.values()}


def test_ab_scores_the_picks_other_weights_move_by_the_pairs_an_ab_timed(tmp_path, capsys):
    """``--ab``: each pick ``--start``'s weights move from the present ones, scored by an A/B row that timed that very
    pair (either way round), the rest listed as untimed; rows of other pairs say nothing."""
    from kernelplan.bench.shapes import BATCH_SIZES
    from kernelplan.bench.sweep import sweep_shapes

    old = dataclasses.replace(WEIGHTS, mma_floor=0.0)
    moves = [(n, m, k) for m, k in sweep_shapes() for n in BATCH_SIZES
             if ws_config.__wrapped__(n, m, k, SMS, w=old) != ws_config(n, m, k, SMS)]
    n, m, k = 512, 768, 3072  # 3072x3072 at n = 128 before 0073's one-block K split, which moves it either way
    assert (n, m, k) in moves and len(moves) >= 2
    present, new = ws_config(n, m, k, SMS), ws_config.__wrapped__(n, m, k, SMS, w=old)
    decoy = next(c for c in ws_candidates(n, m, k) if c not in (present, new))
    rows = [{"m": m, "k": k, "n": n, "here": str(new), "other": str(present), "here_us": 9.6, "other_us": 8.0},
            {"m": m, "k": k, "n": n, "here": str(present), "other": str(new), "here_us": 8.4, "other_us": 9.6},
            {"m": m, "k": k, "n": n, "here": str(present), "other": str(decoy), "here_us": 8.0,
             "other_us": 1.0}]
    ab = tmp_path / "ab.json"
    ab.write_text(json.dumps({"rows": rows}))
    got = fit_ws_rule.ab_pairs([str(ab)])[(n, m, k)]
    assert got[(present, new)] == pytest.approx([9.6 / 8.0, 9.6 / 8.4])
    assert got[(new, present)][0] == pytest.approx(8.0 / 9.6)
    timed, guesses = fit_ws_rule.ab_moves(old, fit_ws_rule.ab_pairs([str(ab)]), sweep_shapes(), BATCH_SIZES)
    assert timed == [pytest.approx((9.6 / 8.0 + 9.6 / 8.4) / 2)] and len(guesses) == len(moves) - 1
    assert (n, m, k) not in [g[:3] for g in guesses]
    table = _table(tmp_path, [_row(n, m, k, {present: 1.0})])  # the tables are read, not used
    assert table and fit_ws_rule.main([str(tmp_path / "tiles.json"), "--start", "mma_floor=0", "--ab", str(ab)]) == 0
    out = capsys.readouterr().out
    assert f"sweep set: {len(moves)} picks move; 1 timed in the A/B" in out and "faster in 0" in out


def test_guard_keeps_the_search_off_a_move_an_ab_timed_slower(tmp_path, capsys):
    """``--guard``: a tile table favours moving a pick; an A/B timed that very move slower than the present pick, so
    the guarded search keeps the pick (docs/design/0058); the same A/B timing it faster leaves the move free."""
    n, m, k = 128, 3584, 3584  # a sweep-set problem: the guard reads the moves over the shape sets
    pick = ws_config(n, m, k, SMS)
    table = tmp_path / "tiles.json"

    def fit(*extra):
        fitted = _fitted(table, capsys, *extra)
        return fitted, ws_config.__wrapped__(n, m, k, SMS, w=fitted)

    for other in [c for c in ws_candidates(n, m, k) if c != pick]:
        table.write_text(json.dumps({"meta": {"sms": SMS}, "rows": [_row(n, m, k, {pick: 2.0, other: 1.0})]}))
        unguarded, moved_to = fit()
        if moved_to == other:
            break
    else:
        pytest.fail("no tile the unguarded search moves this pick to")
    ab = tmp_path / "ab.json"
    for other_us, want in ((9.0, pick), (7.0, other)):  # the move timed 1.125x slower, then 0.875x
        ab.write_text(json.dumps({"rows": [{"m": m, "k": k, "n": n, "here": str(pick), "other": str(other),
                                            "here_us": 8.0, "other_us": other_us}]}))
        assert fit("--guard", str(ab))[1] == want
        losses = fit_ws_rule.ab_losses(unguarded, fit_ws_rule.ab_pairs([str(ab)]), [n])
        assert losses == ([(n, m, k, pick, other, pytest.approx(9.0 / 8.0))] if other_us > 8 else [])


def test_the_rule_ab_bench_picks_both_sides_on_the_gpu_facts_it_is_given():
    """bench/sparse24_rule_ab.py on an H100's DRAM (3.35 TB/s: 5.7 MB in flight): the deeper ring moves no 5120-row
    pick, so --no-deep-ring has nothing to time there (docs/design/0066)."""
    from kernelplan.kernels.gpu_facts import GpuFacts

    h100 = dataclasses.replace(GpuFacts.model(SMS), dram_bytes_per_s=2_619_000e3 * 5120 * 2 / 8)
    assert _rule_ab_moves([(5120, 5120), (5120, 13824)], no_deep_ring=True, gpu=h100) == {}
    assert len(_rule_ab_moves([(5120, 5120), (5120, 13824)], no_deep_ring=True)) == 6


def test_the_rule_ab_bench_times_the_rule_before_the_one_block_k_split():
    """bench/sparse24_rule_ab.py --no-one-block-split (docs/design/0073): the other rule keeps the ping-pong tile of
    one block; the two part only where this rule takes the K split over 2 on 128 rows of x."""
    moves = _rule_ab_moves([(2304, 2048), (2304, 768), (4096, 4096)], batch=(64, 128, 192, 256),
                           no_one_block_split=True)
    assert list(moves) == [(128, 2304, 2048)]
    assert moves[(128, 2304, 2048)] == WsConfig(64, 1, 1, 1, 8, pp=True)
    assert ws_config(128, 2304, 2048, SMS) == WsConfig(128, 1, 1, 2, 8)


def test_the_rule_ab_bench_times_the_rule_before_the_narrow_k_split():
    """bench/sparse24_rule_ab.py --no-narrow-splits (docs/design/0073): the other rule keeps the ping-pong tile of 16-32
    rows of x; the two part only where this rule takes a K split over 2 of 16-32 rows, not where the mid-grid split
    (0074, before it) took the grid first."""
    moves = _rule_ab_moves([(1024, 1024), (1024, 2048), (4096, 4096), (2048, 1024), (4096, 1024), (3072, 768)],
                           batch=(16, 32, 64, 256), no_narrow_splits=True)
    assert sorted(moves) == [(32, 3072, 768), (32, 4096, 1024), (64, 2048, 1024)]
    for p, other in moves.items():
        cfg = ws_config(*p, SMS)
        assert other.pp and other.bn <= 32 and (cfg.wm, cfg.kc, cfg.pp) == (1, 2, False) and cfg.bn <= 32, p
    assert ws_config(32, 1024, 1024, SMS) == WsConfig(32, 1, 1, 4, 8)  # 32 lone ping-pong tiles: the mid-grid split


def test_the_rule_ab_bench_times_the_rule_before_the_mid_grid_k_split():
    """bench/sparse24_rule_ab.py --no-mid-grid-splits (docs/design/0074): the other rule keeps a grid under a quarter
    of the SMs past n = 16; the two part only where this rule takes a K split of more CTAs."""
    moves = _rule_ab_moves([(2048, 1536), (1024, 1280), (4096, 4096)], batch=(16, 48, 64, 1024),
                           no_mid_grid_splits=True)
    assert sorted(moves) == [(48, 1024, 1280), (48, 2048, 1536), (64, 1024, 1280), (64, 2048, 1536)]
    from kernelplan.kernels.sparse24_ws_rule import grid_ctas

    for (n, m, k), other in moves.items():
        cfg = ws_config(n, m, k, SMS)
        assert other.pp and grid_ctas(other, n, m, SMS) < SMS / 4, (n, m)
        assert cfg.kc > 1 and grid_ctas(other, n, m, SMS) < grid_ctas(cfg, n, m, SMS), (n, m)


def test_the_rule_ab_bench_sets_this_rules_constants_by_name():
    """bench/sparse24_rule_ab.py --here-set and --other-set: int, float, bool and range constants of sparse24_ws_rule,
    a bool as True or False, a range as LO-HI (HI included); anything else refused with what it takes."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import sparse24_rule_ab
    from kernelplan.kernels import sparse24_ws_rule

    present = (sparse24_ws_rule.NARROW_SPLIT_K, sparse24_ws_rule.NARROW_SPLIT_MAX_N, sparse24_ws_rule.SMALL_GRID_SHARE)
    try:
        got = sparse24_rule_ab.set_constants(["NARROW_SPLIT_K=512-2048", "NARROW_SPLIT_MAX_N=1024",
                                              "SMALL_GRID_SHARE=0.5"])
        assert got == {"NARROW_SPLIT_K": "512-2048", "NARROW_SPLIT_MAX_N": "1024", "SMALL_GRID_SHARE": "0.5"}
        assert sparse24_ws_rule.NARROW_SPLIT_K == range(512, 2049) and sparse24_ws_rule.NARROW_SPLIT_MAX_N == 1024
        assert sparse24_ws_rule.SMALL_GRID_SHARE == 0.5
        for bad, says in (("WEIGHTS=1", "int, float, bool or range"), ("narrow_split_k=1", "int, float, bool or"),
                          ("NARROW_SPLIT_K=600", "give LO-HI"), ("NARROW_SPLIT_MAX_N=1.5", "give int"),
                          ("NARROW_SPLIT_MAX_N=", "int, float, bool or range"),
                          ("PP_TIE_WIDE_X=0", "give True or False")):
            with pytest.raises(ValueError, match=says):
                sparse24_rule_ab.set_constants([bad])
        assert sparse24_rule_ab.parse_constants(["PP_TIE_WIDE_X=False"], "--other-set") == {"PP_TIE_WIDE_X": False}
        assert sparse24_rule_ab.parse_constants(["PP_TIE_WIDE_X=True"], "--other-set") == {"PP_TIE_WIDE_X": True}
    finally:
        (sparse24_ws_rule.NARROW_SPLIT_K, sparse24_ws_rule.NARROW_SPLIT_MAX_N,
         sparse24_ws_rule.SMALL_GRID_SHARE) = present
        ws_config.cache_clear()


def test_the_rule_ab_bench_times_the_rule_with_k_splits_of_256_rows_of_x_in_one_wave():
    """bench/sparse24_rule_ab.py --split-wide-x (docs/design/0072): the other rule keeps a K split of 256 rows of x in
    a grid of one wave; the two part only where x takes four such tiles or more and this rule takes K whole."""
    moves = _rule_ab_moves([(2048, 8192), (5120, 14336), (8192, 8192)], batch=(256, 512, 1024, 2048),
                           split_wide_x=True)
    assert list(moves) == [(1024, 2048, 8192)]
    assert moves[(1024, 2048, 8192)] == WsConfig(256, 2, 1, 2, 5)
    assert ws_config(1024, 2048, 8192, SMS) == WsConfig(128, 2, 1, 1, 8)


def test_the_rule_ab_bench_times_another_value_of_a_constant_and_restores_it():
    """bench/sparse24_rule_ab.py --other-set (docs/design/0074): the other rule with the mid-grid split's share for
    lone ping-pong tiles at a quarter, as timed; the module's value is back after each pick."""
    from kernelplan.kernels import sparse24_ws_rule

    moves = _rule_ab_moves([(512, 1280), (4096, 4096)], batch=(16, 384, 1024),
                           other_set={"MID_GRID_PP_SHARE": 0.25})
    assert list(moves) == [(384, 512, 1280)]
    cfg = ws_config(384, 512, 1280, SMS)
    assert moves[(384, 512, 1280)].pp and cfg.kc == 2 and not cfg.pp
    assert sparse24_ws_rule.MID_GRID_PP_SHARE == 0.5
