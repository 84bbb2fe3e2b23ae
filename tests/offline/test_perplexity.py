import math

import torch
import torch.nn.functional as F

from pagedweight.offline.perplexity import perplexity, token_windows
from pagedweight.model import load_model
from tests.conftest import BUNDLED_MODEL


def test_windows_score_every_token_but_the_first_once():
    ids = list(range(23))
    windows = token_windows(ids, seq_len=5, max_tokens=None)
    targets = [t for w in windows for t in w[1:]]
    assert targets == ids[1:]
    assert all(len(w) == 6 for w in windows[:-1])
    assert sum(len(w) - 1 for w in token_windows(ids, 5, max_tokens=12)) == 12


def test_perplexity_equals_direct_cross_entropy():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    ids = torch.randint(0, 4096, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    result = perplexity(model, ids, seq_len=16)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in token_windows(ids, 16, None):
            logits = model(torch.tensor([w[:-1]]))[0]
            nll += F.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum").item()
            count += len(w) - 1
    assert result.tokens == count == 49
    assert math.isclose(result.ppl, math.exp(nll / count), rel_tol=1e-5)
