"""The demo's workload (pure parts): prompts sized in tokens, every phase well formed."""

from __future__ import annotations

from sparseety.stack.engine import TENANTS, fit_tokens, phases


def test_fit_tokens_keeps_head_and_tail_within_room() -> None:
    ids = list(range(1000))
    cut = fit_tokens(ids, 100)
    assert len(cut) == 100
    assert cut[:84] == list(range(84)) and cut[84:] == list(range(984, 1000))
    assert fit_tokens(ids[:50], 100) == ids[:50]
    assert fit_tokens(ids[:100], 100) == ids[:100]


def test_phases_cover_every_tenant_and_follow_up_each_session() -> None:
    for quick in (True, False):
        turns = phases(sessions=2, quick=quick)
        first = turns[0]
        assert {t for t, _, _ in first} == set(TENANTS)
        assert sum("Summarise the document." in p for _, p, _ in first) == len(TENANTS)
        assert len(turns) == (2 if quick else 3)
        for follow in turns[1:]:
            assert all("{answer}" in p for _, p, _ in follow)
            assert len(follow) == len(first) - len(TENANTS)  # documents are not followed up
