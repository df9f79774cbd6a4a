"""Which slice of each residual tensor a rank keeps, and a group of one rank."""

from __future__ import annotations

import itertools

import torch

from regional_agent.worker.residual_shards import ResidualGroup, span


def test_the_ranks_spans_cover_every_element_once_in_order() -> None:
    for world in range(1, 6):
        for numel in range(23):
            spans = [span(numel, rank, world) for rank in range(world)]
            assert spans[0][0] == 0
            assert spans[-1][1] == numel
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            assert all(begin <= end for begin, end in spans)
            # Rank 0 keeps a full block: it is never the short one.
            assert spans[0][1] - spans[0][0] == max(e - b for b, e in spans)


def test_a_group_of_one_keeps_the_whole_and_sends_nothing() -> None:
    group = ResidualGroup(0, 1, torch.device("cpu"))
    whole = torch.arange(6.0).reshape(2, 3)
    mine = whole.reshape(-1).clone()
    gathered = group.gather(mine, (2, 3))
    assert gathered is not None
    assert torch.equal(gathered, whole)
    new = whole * 2
    assert group.scatter(new, (2, 3), mine) is mine
    assert torch.equal(mine, new.reshape(-1))
    assert torch.equal(group.scatter(None, (2,), None), torch.zeros(2))
    assert group.scatter(None, (0, 3), None).numel() == 0
    assert group.broadcast("word") == "word"
