"""bench/plot_prefill: fused time over grouped time per shape, and one error line for bad input."""

import json

import pytest

from bench.plot_prefill import main, ratios

VARIANTS = {"results": [
    {"variant": "base", "model": "m", "tokens": 64, "bits": "4", "us": 50.0},
    {"variant": "serial", "model": "m", "tokens": 64, "bits": "4", "us": 80.0},
    {"variant": "base", "model": "m", "tokens": 256, "bits": "8", "us": 300.0},
    {"variant": "base", "model": "other", "tokens": 64, "bits": "4", "us": 1.0},  # no grouped row
]}
LAYER = {"results": [{"model": "m", "tokens": 64, "bf16_grouped_us": 100.0},
                     {"model": "m", "tokens": 256, "bf16_grouped_us": 200.0},
                     {"model": "m", "tokens": 1, "bf16_grouped_us": float("nan")}]}


def test_ratios_divide_each_variant_by_the_grouped_time_of_its_shape():
    out = ratios(VARIANTS, LAYER)
    assert out == {"base": {("m", 64, "4"): 0.5, ("m", 256, "8"): 1.5}, "serial": {("m", 64, "4"): 0.8}}


def test_main_writes_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    v, layer, png = tmp_path / "v.json", tmp_path / "l.json", tmp_path / "out" / "f.png"
    v.write_text(json.dumps(VARIANTS))
    layer.write_text(json.dumps(LAYER))
    assert main([str(v), str(layer), str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_main_refuses_unreadable_or_disjoint_results(tmp_path, capsys):
    v, layer = tmp_path / "v.json", tmp_path / "l.json"
    v.write_text("{not json")
    layer.write_text(json.dumps(LAYER))
    assert main([str(v), str(layer), str(tmp_path / "f.png")]) == 2
    v.write_text(json.dumps({"results": [{"variant": "b", "model": "x", "tokens": 9, "bits": "4", "us": 1.0}]}))
    assert main([str(v), str(layer), str(tmp_path / "f.png")]) == 2
    assert "plot_prefill:" in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()
