"""A small paged model built once per session from the bundled micro-mixtral."""

from __future__ import annotations

import pytest

from tests.conftest import BUNDLED_MODEL, build_once

CALIB_TEXT = {
    "bible": "In the beginning God created the heaven and the earth. And the earth was without form. " * 30,
    "code": "def main(argv):\n    for i, arg in enumerate(argv):\n        print(i, arg)\n    return 0\n" * 30,
}


def quick_config():
    from pagedweight.offline.apl_quantizer import QuantizerConfig
    from pagedweight.offline.calibrate import CalibConfig
    from pagedweight.offline.quantize import QuantizeConfig

    return QuantizeConfig(calib=CalibConfig(seq_len=64, max_tokens_per_file=256, batch_size=8),
                          quantizer=QuantizerConfig(seed_iters=10, split_iters=3))


def write_calib_files(folder):
    for name, text in CALIB_TEXT.items():
        (folder / f"{name}.calib.txt").write_text(text)
    return folder


@pytest.fixture(scope="session")
def calib_files(tmp_path_factory):
    folder = build_once(tmp_path_factory, "calib", write_calib_files)
    return [folder / f"{name}.calib.txt" for name in CALIB_TEXT]


@pytest.fixture(scope="session")
def paged_dir(tmp_path_factory, calib_files):
    from pagedweight.offline.quantize import quantize_model

    return build_once(tmp_path_factory, "paged",
                      lambda folder: quantize_model(BUNDLED_MODEL, folder / "micro", calib_files, quick_config()))
