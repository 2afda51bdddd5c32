"""Memory policies: outputs and provenance on hand-checked examples; the driver."""
import pytest

from memopd import Source, drive, make_policy, random_trajectories
from memopd.memory import (
    POLICIES,
    FullRetention,
    RetrievalRefresh,
    SlidingWindow,
    SuffixRetention,
    SummaryReplacement,
)

A, O, T = Source.ACTION, Source.OBSERVATION, Source.TEMPLATE
MO, MC = 1, 2  # <mem>, </mem>


def test_full_retention():
    u = FullRetention().update([10], [20, 21], [30], context_provenance=[(T, -1, -1)], call=0)
    assert u.ids == [10, 20, 21, 30]
    assert u.provenance == [(T, -1, -1), (A, 0, 0), (A, 0, 1), (O, 0, 0)]


def test_suffix_retention():
    u = SuffixRetention(3).update([10, 11], [20, 21], [30], call=4)
    assert u.ids == [20, 21, 30]
    assert u.provenance == [(A, 4, 0), (A, 4, 1), (O, 4, 0)]
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixRetention(0)


def test_summary_replacement_keeps_last_span():
    act = [20, MO, 21, MC, 22, MO, 23, 24, MC, 25]
    u = SummaryReplacement(MO, MC).update([10, 11], act, [30, 31], call=2)
    assert u.ids == [MO, 23, 24, MC, 30, 31]
    assert u.provenance == [(A, 2, 5), (A, 2, 6), (A, 2, 7), (A, 2, 8), (O, 2, 0), (O, 2, 1)]


def test_summary_replacement_without_span_forgets():
    u = SummaryReplacement(MO, MC).update([10], [20, MO, 21], [30], call=0)
    assert u.ids == [30] and u.provenance == [(O, 0, 0)]


def test_sliding_window():
    pol = SlidingWindow(turns=2)
    ctx, prov = [9], [(T, -1, -1)]
    for t, (a, o) in enumerate([([20], [30]), ([21], [31]), ([22], [32])]):
        u = pol.update(ctx, a, o, context_provenance=prov, call=t)
        ctx, prov = u.ids, u.provenance
    # the initial context stays; turns 1 and 2 remain, turn 0 fell out
    assert ctx == [9, 21, 31, 22, 32]
    assert prov == [(T, -1, -1), (A, 1, 0), (O, 1, 0), (A, 2, 0), (O, 2, 0)]


def test_retrieval_refresh():
    pol = RetrievalRefresh()
    u1 = pol.update([], [20], [30, 31], call=0)
    u2 = pol.update(u1.ids, [21], [32], context_provenance=u1.provenance, call=1)
    assert u2.ids == [20, 21, 32]
    assert u2.provenance == [(A, 0, 0), (A, 1, 0), (O, 1, 0)]


def test_make_policy_errors():
    with pytest.raises(ValueError, match="unknown memory policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="needs mem_open_id"):
        make_policy("summary")


def test_drive_records_contexts():
    tr = drive(make_policy("summary", mem_open_id=MO, mem_close_id=MC), [5, 6],
               [([MO, 40, MC, 41], [50]), ([MO, 42, MC], [51])], initial_context_ids=[7])
    assert [inv.context_ids for inv in tr.invocations] == [[7], [MO, 40, MC, 50]]
    assert tr.invocations[1].provenance == [(A, 0, 0), (A, 0, 1), (A, 0, 2), (O, 0, 0)]
    tr.validate()


@pytest.mark.parametrize("policy", POLICIES)
def test_random_trajectories_valid(policy, seed):
    for tr in random_trajectories(policy, 5, seed=seed, group_size=2):
        tr.validate(vocab_size=128)


def test_make_policy_refuses_keywords_a_policy_does_not_take():
    """The registry passes each policy its declared parameters and refuses the rest: no
    keyword is dropped silently (full, summary and refresh take none)."""
    from memopd.memory import POLICIES, POLICY_CLASSES, SlidingWindow

    assert POLICIES == tuple(POLICY_CLASSES) == ("full", "suffix", "summary", "window", "refresh")
    for name, extra in (("full", "turns"), ("refresh", "turns"), ("summary", "turns"), ("window", "max_tokens")):
        with pytest.raises(TypeError, match=rf"the '{name}' policy takes .*, not {extra}"):
            make_policy(name, mem_open_id=MO, mem_close_id=MC, **{extra: 3})
    assert isinstance(make_policy("window", turns=3), SlidingWindow) and make_policy("window", turns=3).turns == 3
    assert make_policy("suffix", max_tokens=5).max_tokens == 5
