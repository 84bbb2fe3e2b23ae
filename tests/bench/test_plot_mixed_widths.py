"""bench/plot_mixed_widths: the mixed layers' byte-weighted ratios per shape, and one error line for bad input."""

import json

import pytest

from bench.plot_mixed_widths import label, main, over_byte_weighted

LAYER = {"commit": "abc1234", "results": [
    {"model": "mixtral-8x7b", "tokens": 1, "bits_mixed": {"fused_us": 160.0, "over_byte_weighted": 1.15}},
    {"model": "mixtral-8x7b", "tokens": 256, "bits_mixed": {"fused_us": 1880.0}},  # no byte-weighted time
    {"model": "qwen1.5-moe-a2.7b", "tokens": 4, "bits_4": {"fused_us": 56.0}},  # no mixed layer
]}


def test_ratios_are_read_from_the_mixed_cells_that_carry_them(tmp_path):
    assert over_byte_weighted(LAYER) == {("mixtral-8x7b", 1): 1.15}
    assert label(tmp_path / "apl_moe_kernel_x.json", LAYER) == "abc1234 (apl_moe_kernel_x)"
    assert label(tmp_path / "y.json", {"results": []}) == "y"


def test_main_writes_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    a, b, png = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out" / "f.png"
    a.write_text(json.dumps(LAYER))
    b.write_text(json.dumps({**LAYER, "commit": "def5678"}))
    assert main([str(png), str(a), str(b)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_main_refuses_unreadable_or_empty_results(tmp_path, capsys):
    a = tmp_path / "a.json"
    a.write_text("{not json")
    assert main([str(tmp_path / "f.png"), str(a)]) == 2
    a.write_text(json.dumps({"results": [{"model": "m", "tokens": 1, "bits_4": {}}]}))
    assert main([str(tmp_path / "f.png"), str(a)]) == 2
    a.write_text(json.dumps([1, 2]))
    assert main([str(tmp_path / "f.png"), str(a)]) == 2
    assert capsys.readouterr().err.count("plot_mixed_widths:") == 3
    assert not (tmp_path / "f.png").exists()
