"""Per-row top-k / top-p filtering and sampling with exact logprobs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentrl.engines.hf_sampling import RowSampling, filter_logits, sample_rows  # noqa: E402


def reference_filter(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    out = row.clone()
    if k:
        out[out < out.topk(k).values[-1]] = float("-inf")
    probs = out.softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    drop = order[before > p]
    drop = drop[drop != order[0]]
    out[drop] = float("-inf")
    return out


@pytest.mark.parametrize(("ks", "ps"), [([5, 0, 50], [1.0, 0.5, 0.9]), ([3, 7, 1], [1.0, 0.6, 1.0])])
def test_filter_matches_a_per_row_reference(ks: list[int], ps: list[float]) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 200) * 3
    got = filter_logits(logits, torch.tensor(ks), torch.tensor(ps))
    for i, (k, p) in enumerate(zip(ks, ps, strict=True)):
        assert torch.equal(got[i].isinf(), reference_filter(logits[i], k, p).isinf())
        kept = ~got[i].isinf()
        assert torch.equal(got[i][kept], logits[i][kept])


def test_sampled_tokens_lie_in_the_nucleus_and_logprobs_are_renormalised() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    rows = [RowSampling(0.5, 3, 1.0, None), RowSampling(1.0, 0, 0.3, None),
            RowSampling(0.0, 0, 1.0, None), RowSampling(2.0, 0, 1.0, torch.Generator().manual_seed(0))]
    ids, logprobs = sample_rows(logits, rows, torch.Generator().manual_seed(0))
    top3 = set(logits[0].topk(3).indices.tolist())
    assert ids[0] in top3
    expect0 = (logits[0] / 0.5).masked_fill(~torch.isin(torch.arange(100), torch.tensor(sorted(top3))), float("-inf"))
    assert logprobs[0] == pytest.approx(float(expect0.log_softmax(-1)[ids[0]]), abs=1e-5)
    assert ids[2] == int(logits[2].argmax())  # greedy; logprob under the plain distribution
    assert logprobs[2] == pytest.approx(float(logits[2].log_softmax(-1)[ids[2]]), abs=1e-6)
    assert logprobs[3] == pytest.approx(float((logits[3] / 2.0).log_softmax(-1)[ids[3]]), abs=1e-6)
    assert all(lp <= 0 for lp in logprobs)
