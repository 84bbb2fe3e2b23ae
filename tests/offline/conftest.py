"""A small paged model built once per session from the bundled micro-mixtral."""

from __future__ import annotations

import pytest

from tests.conftest import BUNDLED_MODEL

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


@pytest.fixture(scope="session")
def calib_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calib")
    files = []
    for name, text in CALIB_TEXT.items():
        (folder / f"{name}.calib.txt").write_text(text)
        files.append(folder / f"{name}.calib.txt")
    return files


@pytest.fixture(scope="session")
def paged_dir(tmp_path_factory, calib_files):
    from pagedweight.offline.quantize import quantize_model

    return quantize_model(BUNDLED_MODEL, tmp_path_factory.mktemp("paged") / "micro", calib_files, quick_config())
