"""bench/ncu_stall_table.py on a small source-page CSV of ncu's layout: two kernel sections,
stall shares that sum to one, the hottest instruction first, gzip read like plain text."""

from __future__ import annotations

import gzip
import json

from bench import ncu_stall_table

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_long_sb","stall_math","stall_long_sb (Not Issued)"')


def _section(name: str, rows: list[tuple[str, str, int, int, int, int]]) -> str:
    lines = [f'"Kernel Name","void {name}<(int)0, (int)1>(const long long *, int)",', HEADER]
    lines += [f'"{a}","{src}","{s}","{n}","{lsb}","{math}","0"' for a, src, s, n, lsb, math in rows]
    return "\n".join(lines)


def test_shares_and_hottest_instructions_per_kernel(tmp_path, capsys):
    csv_text = _section("gate_up", [("0x10", "PRMT R1, R2, 0x5410, R3", 30, 1000, 25, 5),
                                    ("0x20", "LOP3.LUT R4, R5, 0x6, RZ", 10, 2000, 0, 10)]) + "\n" + \
        _section("down", [("0x30", "ERRBAR", 4, 10, 1, 3)])
    path = tmp_path / "k_sass.csv.gz"
    path.write_bytes(gzip.compress(csv_text.encode()))
    out = tmp_path / "stalls.json"
    assert ncu_stall_table.main([str(path), "--top", "1", "--json", str(out)]) == 0
    gate_up, down = json.loads(out.read_text())[path.name]
    assert gate_up["kernel"] == "void gate_up<(int)0, (int)1>" and gate_up["samples"] == 40
    assert gate_up["reasons"] == {"long_sb": 25 / 40, "math": 15 / 40}  # "Not Issued" columns left out
    assert gate_up["instructions_executed"] == 3000
    assert gate_up["hottest"] == [{"sass": "PRMT R1, R2, 0x5410, R3", "share": 0.75, "reason": "long_sb"}]
    assert down["hottest"][0]["reason"] == "math" and down["samples"] == 4
    assert "void down<(int)0, (int)1>" in capsys.readouterr().out


def test_a_missing_file_is_one_error_line(tmp_path, capsys):
    assert ncu_stall_table.main([str(tmp_path / "nope.csv")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
