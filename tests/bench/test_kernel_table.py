"""The kernel table's columns (bench/tables.py): the engine's bf16 GEMV appears only where a
result timed it."""

from bench.tables import kernel_model_table


def _row(tokens, gemv=None):
    row = {"tokens": tokens, "bf16_grouped_us": 100.0,
           "bits_4": {"fused_us": 50.0, "fused_over_floor": 2.0}}
    if gemv is not None:
        row["bf16_gemv_us"] = gemv
    return row


def test_no_gemv_column_without_gemv_timings():
    lines = kernel_model_table([_row(1), _row(16)])
    assert not any("GEMV" in line for line in lines)
    assert all(line.count("|") == 5 for line in lines)


def test_gemv_column_where_timed_and_blank_elsewhere():
    lines = kernel_model_table([_row(1, gemv=40.0), _row(256)])
    assert "bf16 engine GEMV" in lines[0]
    assert all(line.count("|") == 6 for line in lines)  # every row as wide as the header
    assert "| 40.0 |" in lines[2]
    assert lines[3].split("|")[4].strip() == ""  # 256 tokens: no GEMV timing


def test_tables_fill_the_kernel_page_and_draw_its_figure_only_when_rewriting(tmp_path, monkeypatch):
    """`python -m bench tables` writes the kernel tables between the page's markers and draws
    the page's figure beside it; `--check` reports the stale page and writes nothing."""
    from bench import tables

    page = tmp_path / "kernel.md"
    page.write_text("# Kernel\n\n<!-- table: kernel -->\nold\n<!-- /table -->\n")
    monkeypatch.setattr(tables, "DOCS", tmp_path)
    assert tables.main(["--check"]) == 1
    assert "old" in page.read_text() and not (tmp_path / "kernel_speedup.png").exists()
    assert tables.main([]) == 0
    text = page.read_text()
    assert "old" not in text and "**mixtral-8x7b**" in text and "| tokens | 3 bits |" in text
    assert (tmp_path / "kernel_speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert tables.main(["--check"]) == 0
