"""``gds-offload rok``: the sweep writes its JSON and plot and recommends a point that fits."""
from __future__ import annotations

import json

from gds_offload.bench.train.rok import RokPoint, frontier, recommend
from gds_offload.cli import main

MiB = 1 << 20


def _pt(placement: str, batch: int, tps: float, mem: int) -> RokPoint:
    return RokPoint(placement, batch, "ok", tps, 1.0, mem)


def test_recommend_picks_the_fastest_point_that_fits() -> None:
    pts = [_pt("keep", 4, 100, 400 * MiB), _pt("all", 8, 180, 250 * MiB), _pt("recompute", 8, 120, 150 * MiB)]
    assert recommend(pts, 300 * MiB).placement == "all"
    assert recommend(pts, 200 * MiB).placement == "recompute"
    assert recommend(pts, 100 * MiB) is None
    assert [p.placement for p in frontier(pts)] == ["recompute", "all"]


def test_rok_command_writes_json_and_plot(tmp_path) -> None:
    out, png = tmp_path / "rok.json", tmp_path / "rok.png"
    rc = main([
        "rok", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--vocab", "256",
        "--batches", "1,2", "--placements", "keep,all", "--steps", "1", "--warmup", "1",
        "--path", str(tmp_path), "--memory", "1GiB", "--out", str(out), "--plot", str(png),
    ])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("gds-offload rok") and "--batches 1,2" in doc["command"]
    assert len(doc["points"]) == 4 and all(p["status"] == "ok" for p in doc["points"])
    best = doc["recommendations"][0]["best"]
    assert best is not None and best["peak_activation_bytes"] <= 1 << 30
    assert png.stat().st_size > 1000


def test_rok_rejects_bad_placements(capsys) -> None:
    assert main(["rok", "--placements", "keep,offload-everything", "--out", "/nonexistent/x.json"]) == 2
    assert "unknown" in capsys.readouterr().err
