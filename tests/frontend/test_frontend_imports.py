"""The front end is torch-free: the gateway imports it without the worker's stack."""

import subprocess
import sys


def test_frontend_imports_without_torch():
    code = (
        "import sys\n"
        "import pagedweight.frontend\n"
        "from pagedweight.frontend import tokenizer, chat_template, detokenizer\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "engine = sorted(m for m in sys.modules if m.startswith(('pagedweight.engine', 'pagedweight.model')))\n"
        "assert not heavy and not engine, (heavy[:5], engine)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
