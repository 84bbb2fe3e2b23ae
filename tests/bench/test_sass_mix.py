"""bench/sass_mix.py on a small nvdisasm-shaped listing: only the innermost loops holding HMMA
are counted, per weight (8 weights per HMMA), predicated instructions by their opcode."""

from bench import sass_mix

LISTING = """
.L_x_1:
        /*0010*/                   IMAD.SHL.U32 R1, R2, 0x2, RZ ;
.L_x_2:
        /*0020*/                   PRMT R3, R4, R5, R6 ;
        /*0030*/                   LOP3.LUT R7, R3, 0x7777, RZ, 0xc0, !PT ;
        /*0040*/               @P0 SHF.R.U32.HI R8, RZ, 0x10, R7 ;
        /*0050*/                   HMMA.16816.F32.BF16 R10, R12, R14, R10 ;
        /*0060*/               @P1 BRA `(.L_x_2) ;
        /*0070*/                   HMMA.16816.F32.BF16 R10, R12, R14, R10 ;
        /*0080*/                   BRA `(.L_x_1) ;
.L_x_3:
        /*0090*/                   LDG.E R1, desc[UR4][R2.64] ;
        /*00a0*/                   BRA `(.L_x_3) ;
"""


def test_only_the_innermost_hmma_loop_is_counted_per_weight():
    (inner,) = sass_mix.step_loop_mixes(LISTING)
    assert inner["hmma"] == 1 and inner["instructions"] == 5
    assert inner["per_weight"] == round(5 / 8, 4)
    assert inner["mix"] == {"PRMT": 0.125, "LOP3": 0.125, "SHF": 0.125, "HMMA": 0.125, "BRA": 0.125}
    assert inner["alu_per_weight"] == round(3 / 8, 4)


def test_bad_defines_are_one_error_line_and_exit_2(capsys):
    assert sass_mix.main(["apl_gemv<0, 0, true, true, 1>", "APL_GEMV_MIN_BLOCKS=three"]) == 2
    assert "NAME=integer" in capsys.readouterr().err


TILES_LISTING = """
.L_x_5:
        /*0010*/                   PRMT R3, R4, R5, R6 ;
        /*0020*/                   WARPGROUP.ARRIVE ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, R68, gdesc[UR20], R24 ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, R72, gdesc[UR24], R24, gsb0 ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0060*/               @P1 BRA `(.L_x_5) ;
.L_x_6:
        /*0070*/                   HMMA.16816.F32.BF16 R10, R12, R14, R10 ;
        /*0080*/                   HMMA.16816.F32.BF16 R16, R12, R18, R16 ;
        /*0090*/               @P1 BRA `(.L_x_6) ;
"""


def test_tiles_loops_count_weights_per_hgmma_and_per_fragment():
    """A wgmma m64nNk16 is 8 weights a thread; in a tiles mma.sync loop each fragment feeds NT8 mma."""
    wgmma, mma_sync = sass_mix.step_loop_mixes(TILES_LISTING, tiles=2)
    assert wgmma["hgmma"] == 2 and wgmma["per_weight"] == round(6 / 16, 4)
    assert mma_sync["hmma"] == 2 and mma_sync["per_weight"] == round(3 / 8, 4)  # 2 HMMA / NT8 2 = one fragment


def test_a_malformed_instance_is_one_error_line_and_exit_2(capsys):
    assert sass_mix.main(["apl_gemv<0, 0, true>"]) == 2
    assert "apl_gemv<CLS, MODE" in capsys.readouterr().err

