"""Placement strategies and the routing statistics file."""

from __future__ import annotations

import json

import pytest
import torch

from kt_sglang.placement import PlacementStats, StatsRecorder, plan_hot_experts, slot_map

LAYERS = [1, 2, 3]  # layer 0 dense, as in DeepSeek


@pytest.fixture
def stats_file(tmp_path):
    path = tmp_path / "stats.json"
    layers = {"1": [5, 0, 9, 1, 7, 0], "2": [0, 3, 3, 8, 0, 1], "3": [2, 2, 2, 2, 2, 9]}
    data = {"format": "kt-sglang-placement-stats", "version": 1, "num_experts": 6, "layers": layers}
    path.write_text(json.dumps(data))
    return path


def test_strategies_on_a_known_statistics_file(stats_file):
    stats = PlacementStats.read(stats_file)
    assert plan_hot_experts("uniform", LAYERS, 6, 6) == {1: [0, 1], 2: [0, 1], 3: [0, 1]}
    assert plan_hot_experts("front-loading", LAYERS, 6, 8) == {1: [0, 1, 2, 3, 4, 5], 2: [0, 1], 3: []}
    # most routed per layer; ties go to the lower id
    assert plan_hot_experts("frequency", LAYERS, 6, 6, stats) == {1: [2, 4], 2: [1, 3], 3: [0, 5]}
    a = plan_hot_experts("random", LAYERS, 6, 6, seed=3)
    assert a == plan_hot_experts("random", LAYERS, 6, 6, seed=3)  # seeded
    assert all(len(v) == 2 and len(set(v)) == 2 for v in a.values())
    assert a != plan_hot_experts("random", LAYERS, 6, 6, seed=4)


def test_slot_map_orders_hot_experts_by_id():
    assert slot_map([4, 1], 6).tolist() == [-1, 0, -1, -1, 1, -1]


@pytest.mark.parametrize(
    "args, message",
    [
        (("best", LAYERS, 6, 6), "unknown placement strategy 'best'"),
        (("uniform", LAYERS, 6, 19), "19 hot experts requested; the model has 6 experts x 3 MoE layers = 18"),
        (("frequency", LAYERS, 6, 6), "needs routing statistics"),
    ],
)
def test_bad_placement_requests(args, message):
    with pytest.raises(ValueError, match=message):
        plan_hot_experts(*args)


def test_statistics_file_errors(tmp_path, stats_file):
    with pytest.raises(ValueError, match="does not exist"):
        PlacementStats.read(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"format": "kt-sglang-placement-stats", "version": 1, "num_experts": 6, "layers": {"1": [1]}}'
    )
    with pytest.raises(ValueError, match="layer 1 must hold 6"):
        PlacementStats.read(bad)
    with pytest.raises(ValueError, match="statistics are for 6 experts per layer; the model has 8"):
        PlacementStats.read(stats_file).counts(1, 8)


def test_recorder_merges_with_the_file_and_writes_atomically(tmp_path, stats_file):
    rec = StatsRecorder(stats_file, 6, interval_s=3600)
    rec.add(1, torch.tensor([[0, 2], [2, -1]]))
    rec.add(3, torch.tensor([[5, 4]], dtype=torch.int32))
    rec.flush()
    merged = PlacementStats.read(stats_file)
    assert merged.layers[1] == [6, 0, 11, 1, 7, 0]
    assert merged.layers[3] == [2, 2, 2, 2, 3, 10]
    assert merged.layers[2] == [0, 3, 3, 8, 0, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temporary left behind
    rec2 = StatsRecorder(stats_file, 6, interval_s=3600)  # a second run adds to the first
    rec2.add(2, torch.tensor([[0, 0]]))
    rec2.flush()
    assert PlacementStats.read(stats_file).layers[2] == [2, 3, 3, 8, 0, 1]
