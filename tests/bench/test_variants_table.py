"""bench/variants_table: an apl_gemv_variants result side by side per shape, and one error line for bad input."""

import json

from bench.variants_table import main, table

ROWS = [
    {"variant": "base", "model": "mixtral-8x7b", "tokens": 1, "bits": "mixed", "us": 160.04, "over_byte_weighted": 1.147},
    {"variant": "base", "model": "mixtral-8x7b", "tokens": 1, "bits": "5", "us": 216.5},
    {"variant": "off", "model": "mixtral-8x7b", "tokens": 1, "bits": "mixed", "us": 174.7, "over_byte_weighted": 1.249},
]


def test_table_puts_the_variants_side_by_side_in_run_order():
    assert table(ROWS) == ["shape base off", "mix1/mixed 160.0(1.147) 174.7(1.249)", "mix1/5 216.5 -"]


def test_main_prints_the_table_or_one_error_line(tmp_path, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"results": ROWS}))
    assert main([str(good)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "shape base off"
    for text in ("{not json", json.dumps({"rows": []}), json.dumps({"results": [{"variant": "b"}]})):
        bad.write_text(text)
        assert main([str(bad)]) == 2
    assert main([str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("variants_table: cannot read") for line in err)
