"""`memopd.pack` returns the batches of the per-token Python reference bit for bit.

The reference (`tests/_pack_reference.py`) is the list-building pack compiler the
array-based one replaced. Over randomized trajectories of every memory policy (empty
prefixes and contexts, missing log-probs or provenance, shared and distinct group ids,
tight and loose budgets) and every layout, action domain and share_prefix mode, every
tensor of the PackedBatch and its AttentionMeta must be identical (dtype, shape, bits),
and broken records must raise the same error with the same message.
"""
import contextlib
import math
from dataclasses import fields

import numpy as np
import pytest
import torch
from _pack_reference import reference_from_segments, reference_pack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memopd import Invocation, Trajectory, pack, packing, random_trajectories
from memopd.errors import UserError
from memopd.layout import AttentionMeta, SegmentKind
from memopd.memory import POLICIES
from memopd.packing import PackError
from memopd.records import validate_trajectories

LAYOUT_NAMES = ("aligned", "aligned_unshared", "independent", "flatten", "aligned_shared", "unshared", "packed")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same_tensor(name, got, want):
    assert isinstance(got, torch.Tensor), name
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.device == want.device, name
    assert torch.equal(_bits(got), _bits(want)), f"{name} differs"


def assert_same_meta(got: AttentionMeta, want: AttentionMeta, where="attn"):
    for f in fields(AttentionMeta):
        g, w = getattr(got, f.name), getattr(want, f.name)
        if isinstance(w, torch.Tensor):
            assert_same_tensor(f"{where}.{f.name}", g, w)
        else:
            assert type(g) is type(w) and g == w, f"{where}.{f.name}: {g!r} != {w!r}"
    assert getattr(got, "_checked", False) == getattr(want, "_checked", False)


def assert_same_batch(got, want):
    for f in fields(want):
        g, w = getattr(got, f.name), getattr(want, f.name)
        if isinstance(w, AttentionMeta):
            assert_same_meta(g, w)
        elif isinstance(w, torch.Tensor):
            assert_same_tensor(f.name, g, w)
        else:
            assert type(g) is type(w) and g == w, f"{f.name}: {g!r} != {w!r}"


def outcome(fn, *args, **kw):
    try:
        return fn(*args, **kw), None
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return None, e


def _strip(trajs, data):
    """Vary the records: drop log-probs / provenance, empty prefixes, merge group ids."""
    out = []
    for tr in trajs:
        invs = []
        no_lp = data.draw(st.booleans())
        no_prov = data.draw(st.booleans())
        no_q = data.draw(st.integers(0, 3)) == 0
        for inv in tr.invocations:
            invs.append(Invocation(
                prefix_ids=[] if no_q else list(inv.prefix_ids),
                context_ids=list(inv.context_ids),
                action_ids=list(inv.action_ids),
                sample_logprobs=None if no_lp else inv.sample_logprobs,
                provenance=None if no_prov else inv.provenance,
                observation_ids=inv.observation_ids,
            ))
        gid = tr.group_id if data.draw(st.booleans()) else "same"
        out.append(Trajectory(invs, reward=tr.reward, task_id=tr.task_id, group_id=gid))
    return out


@st.composite
def batches(draw):
    policy = draw(st.sampled_from(POLICIES))
    n = draw(st.integers(1, 7))
    trajs = random_trajectories(
        policy, n, seed=draw(st.integers(0, 2**20)), group_size=draw(st.integers(1, 4)),
        calls=(1, draw(st.integers(1, 6))), prefix_len=(0, draw(st.integers(0, 12))),
        action_len=(1, draw(st.integers(1, 9))), obs_len=(0, draw(st.integers(0, 8))),
        initial_context_len=(0, draw(st.integers(0, 4))), with_logprobs=draw(st.booleans()),
    )
    if draw(st.booleans()):
        trajs = draw(st.builds(lambda d: _strip(trajs, d), st.data()))
    return trajs


def options(layouts=LAYOUT_NAMES):
    return st.fixed_dictionaries({
        "layout": st.sampled_from(layouts),
        "share_prefix": st.sampled_from(("trajectory", "group")),
        "action_domain": st.sampled_from(("exact", "naive")),
        "max_tokens": st.sampled_from((8, 24, 40, 64, 128, 8192)),
        "pad_id": st.integers(0, 3),
        "vocab_size": st.sampled_from((None, 128, 60)),
        "validate": st.booleans(),
    })


def records_valid(trajs) -> bool:
    try:
        validate_trajectories(trajs)
    except Exception:  # noqa: BLE001
        return False
    return True


@contextlib.contextmanager
def python_reader():
    """pack as in a checkout without the C++ core: records read by the Python reader."""
    saved = packing._core_reader
    packing._core_reader = lambda: None
    try:
        yield
    finally:
        packing._core_reader = saved


def check_against_reference(trajs, kw):
    """Same batch, or the same error word for word, whichever reader (C++ core or
    Python) reads the records. Unvalidated invalid records (the caller's promise broken)
    may instead get one clear line (a UserError) from pack."""
    want, err = outcome(reference_pack, trajs, **kw)
    for reader in (contextlib.nullcontext, python_reader):
        with reader():
            got, err2 = outcome(pack, trajs, **kw)
        check_outcome(trajs, kw, want, err, got, err2)


def check_outcome(trajs, kw, want, err, got, err2):
    if not kw["validate"] and not records_valid(trajs):
        if err2 is not None:
            assert isinstance(err2, UserError) and "\n" not in str(err2), repr(err2)
            return
        assert err is None, f"reference raised {err!r}, pack returned a batch"
        assert_same_batch(got, want)
        return
    if err is not None:
        assert err2 is not None, f"reference raised {err!r}, pack returned a batch"
        assert type(err2) is type(err) and str(err2) == str(err)
        return
    assert err2 is None, f"pack raised {err2!r}, the reference packed the batch"
    assert_same_batch(got, want)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajs=batches(), kw=options())
def test_same_batches_as_reference(trajs, kw):
    check_against_reference(trajs, kw)


def _corrupt(trajs, kind, data):
    b = data.draw(st.integers(0, len(trajs) - 1))
    tr = trajs[b]
    t = data.draw(st.integers(0, len(tr.invocations) - 1))
    inv = tr.invocations[t]

    def pick(xs):
        return data.draw(st.integers(0, len(xs) - 1))

    if kind == "negative_id":
        name = data.draw(st.sampled_from([n for n in ("prefix_ids", "context_ids", "action_ids", "observation_ids")
                                          if getattr(inv, n)]))
        getattr(inv, name)[pick(getattr(inv, name))] = -data.draw(st.integers(1, 5))
    elif kind == "large_id":
        inv.action_ids[pick(inv.action_ids)] = data.draw(st.sampled_from((128, 500, 2**40)))
    elif kind == "bad_logprob" and inv.sample_logprobs:
        inv.sample_logprobs[pick(inv.sample_logprobs)] = data.draw(st.sampled_from((0.5, math.nan, math.inf, -math.inf)))
    elif kind == "logprob_count" and inv.sample_logprobs:
        inv.sample_logprobs.append(-1.0)
    elif kind == "empty_action":
        inv.action_ids = []
        inv.sample_logprobs = None if inv.sample_logprobs is None else []
    elif kind == "prefix_differs" and t > 0:
        inv.prefix_ids = inv.prefix_ids + [5]
    elif kind == "provenance_value" and inv.provenance:
        i = pick(inv.provenance)
        src, call, off = inv.provenance[i]
        inv.provenance[i] = data.draw(st.sampled_from([(src, call, off + 1), (src, t, off), (src, call, -1), (7, call, off),
                                                       (0, t, -1), (1, -1, 0), (2, call, 10**6), (src, call)]))
    elif kind == "provenance_copy" and inv.provenance:
        i = pick(inv.provenance)
        if inv.provenance[i][0] != 0:
            inv.context_ids[i] = inv.context_ids[i] + 1
    elif kind == "provenance_count" and inv.provenance is not None:
        inv.provenance = inv.provenance + [(0, -1, -1)]
    elif kind == "no_observation":
        inv.observation_ids = None
    elif kind == "reward":
        tr.reward = data.draw(st.sampled_from((math.nan, math.inf, "x", None)))
    elif kind == "no_invocations":
        tr.invocations = []
    elif kind == "not_a_trajectory":
        trajs[b] = {"invocations": []}
    elif kind == "empty_call":
        inv.prefix_ids, inv.context_ids, inv.provenance = [], [], None
        for other in tr.invocations:
            other.prefix_ids = []
    return trajs


CORRUPTIONS = ("negative_id", "large_id", "bad_logprob", "logprob_count", "empty_action", "prefix_differs",
               "provenance_value", "provenance_copy", "provenance_count", "no_observation", "reward",
               "no_invocations", "not_a_trajectory", "empty_call")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajs=batches(), kind=st.sampled_from(CORRUPTIONS), data=st.data(),
       kw=options(("aligned", "aligned_unshared", "independent", "flatten")))
def test_broken_records_same_error(trajs, kind, data, kw):
    """Validated: the reference's error, word for word (the fast checks must never accept
    what the record rules reject). Unvalidated: the same batch, or one clear line where
    the reference crashed."""
    trajs = _corrupt(trajs, kind, data)
    check_against_reference(trajs, kw)


@pytest.mark.parametrize("layout", ("aligned", "aligned_unshared", "independent", "flatten"))
@pytest.mark.parametrize("bad", (2**63, 2**70, -(2**70), 1e300, 10**400))
@pytest.mark.parametrize("validate", (True, False))
def test_ids_outside_int64_are_one_clear_line(layout, bad, validate):
    trajs = random_trajectories("summary", 3, seed=0)
    trajs[1].invocations[1].context_ids[0] = bad if not isinstance(bad, float) else int(bad)
    trajs[1].invocations[1].provenance = None  # the bad id is no copy of anything
    with pytest.raises(UserError) as e:
        pack(trajs, layout=layout, validate=validate)
    msg = str(e.value)
    assert "\n" not in msg and "trajectory 1, call 1" in msg and "context_ids[0]" in msg
    # an id through the constructor (a float that is an integer, e.g. 1e300): refused there
    # or by pack, in one line either way
    inv = trajs[1].invocations[1]
    with pytest.raises(UserError, match=r"^[^\n]*context_ids\[0\][^\n]*$"):
        trajs[1].invocations[1] = Invocation(inv.prefix_ids, [1e300] + inv.context_ids[1:], inv.action_ids,
                                             inv.sample_logprobs, inv.provenance, inv.observation_ids)
        pack(trajs, layout=layout, validate=validate)


def test_ids_outside_vocab_named_by_the_record_rule():
    trajs = random_trajectories("full", 3, seed=1)
    trajs[2].invocations[0].action_ids[0] = 2**70
    with pytest.raises(UserError, match=r"trajectory 2, call 0: action_ids\[0\] = 1180591620717411303424 is out of range "
                                         r"for vocab_size 128"):
        pack(trajs, vocab_size=128)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from(list(SegmentKind)), st.integers(-2, 8)), max_size=9))
def test_from_segments_same_as_reference(segs):
    """AttentionMeta.from_segments (vectorised) builds, or refuses, exactly what the
    per-segment reference does, on well- and ill-formed links."""
    cu = [0]
    for n, _, _ in segs:
        cu.append(cu[-1] + n)
    links, kinds = [s[2] for s in segs], [int(s[1]) for s in segs]
    want, err = outcome(reference_from_segments, cu, links, kinds)
    got, err2 = outcome(AttentionMeta.from_segments, cu, links, kinds)
    if err is not None:
        assert type(err2) is type(err) and str(err2) == str(err)
    else:
        assert err2 is None, err2
        assert_same_meta(got, want)


def test_harness_can_fail():
    """The comparison notices one flipped bit anywhere."""
    trajs = random_trajectories("summary", 4, seed=3, group_size=2)
    a = reference_pack(trajs, share_prefix="group", action_domain="naive")
    b = pack(trajs, share_prefix="group", action_domain="naive")
    assert_same_batch(b, a)
    b.attn.prefix_end[3] += 1
    with pytest.raises(AssertionError, match="attn.prefix_end"):
        assert_same_batch(b, a)
    b = pack(trajs, share_prefix="group", action_domain="naive")
    b.sample_logprobs[0] = torch.nextafter(b.sample_logprobs[0], torch.tensor(0.0))
    with pytest.raises(AssertionError, match="sample_logprobs"):
        assert_same_batch(b, a)
    with pytest.raises(AssertionError):
        assert_same_batch(pack(trajs, share_prefix="trajectory"), a)
    with pytest.raises(PackError):
        pack(trajs, max_tokens=3)


@settings(max_examples=150, deadline=None)
@given(trajs=batches(), need_src=st.booleans(), check=st.booleans(), kind=st.sampled_from((None,) + CORRUPTIONS),
       data=st.data())
def test_core_reader_equals_python_reader(trajs, need_src, check, kind, data):
    """The C++ record reader and the Python one give the same arrays, and the same verdict
    of the fast record checks, on valid and broken records."""
    if packing._core_reader() is None:
        pytest.skip("memopd._C has no read_records (core not built from this checkout)")
    if kind is not None:
        trajs = _corrupt(trajs, kind, data)
    got, err = outcome(packing._Records, trajs, need_src, check)
    with python_reader():
        want, err2 = outcome(packing._Records, trajs, need_src, check)
    assert (err is None) == (err2 is None) and str(err) == str(err2)
    if err is not None:
        return
    for name in ("ids", "lps", "has_lp", "n_calls", "x_len", "a_len", "q_len", "q_off_traj", "x_off", "a_off", "traj", "t",
                 "src", "has_prov"):
        w, g = getattr(want, name, None), getattr(got, name, None)
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.array_equal(g, w, equal_nan=w.dtype.kind == "f"), name
    assert got.odd_prefix == want.odd_prefix
    if check:
        for vocab in (None, 60):
            assert got.valid(trajs, vocab) == want.valid(trajs, vocab)
    # a record that is not plain (a numpy id, an id past int64) is left to the Python reader
    core = packing._core_reader()
    trajs = [tr for tr in trajs if isinstance(tr, Trajectory) and tr.invocations]
    if trajs:
        trajs[0].invocations[0].action_ids = [np.int64(5)]
        assert core(trajs, packing.Trajectory, need_src, check) is None
        trajs[0].invocations[0].action_ids = [2**64]
        assert core(trajs, packing.Trajectory, need_src, check) is None
