"""Segment canonicalization and radix keys: a key may be shared only when the KV behind it is the same."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_pic.radix_ext.radix_tree import RadixKey
from sglang_pic.radix_ext.segments import Segment, canonicalize, pdep_namespace, segment_keys, tail_key
from sglang_pic.radix_ext.segments import namespaces_before, recompute_namespaces


def P(*t: int) -> Segment:
    return Segment("prefix", t)


def S(*t: int) -> Segment:
    return Segment("span", t)


def D(*t: int) -> Segment:
    return Segment("pdep", t)


# ---- canonicalize -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, canonical",
    [
        ([P(1, 2)], [P(1, 2)]),
        ([P(), S(3)], [S(3)]),
        ([P(1), D(2, 3)], [P(1, 2, 3)]),
        ([D(2, 3), S(4)], [P(2, 3), S(4)]),
        ([P(1), D(), D(2), S(5), D(6), D(), D(7)], [P(1, 2), S(5), D(6, 7)]),
        ([P(1), S(2), D(), S(3)], [P(1), S(2), S(3)]),
        ([P(1), S(2), D(3), S(4), D(5)], [P(1), S(2), D(3), S(4), D(5)]),
        ([], []),
    ],
)
def test_canonicalize(raw, canonical):
    assert canonicalize(raw) == canonical
    assert canonicalize(canonical) == canonical


def test_empty_span_is_an_error_naming_it():
    with pytest.raises(ValueError, match="segment 2 is an empty span"):
        canonicalize([P(1), S(2), S()])


def test_prefix_only_first():
    with pytest.raises(ValueError, match="prefix"):
        canonicalize([S(1), P(2)])


def test_unknown_kind_rejected():
    with pytest.raises(ValueError):
        Segment("system", (1,))


# ---- segment_keys -------------------------------------------------------------------------------------------------
def test_keys_per_kind():
    keys = segment_keys([P(1, 2), S(3, 4), D(5)])
    assert keys[0] == RadixKey((1, 2), None)
    assert keys[1] == RadixKey((3, 4), "span")
    assert keys[2].token_ids == (5,) and keys[2].extra_key == pdep_namespace([P(1, 2), S(3, 4)])
    assert keys[2].extra_key.startswith("pdep:") and len(keys[2].extra_key) == len("pdep:") + 64


def test_prefix_shares_with_plain_prompt_but_pdep_does_not():
    plain = segment_keys([P(1, 2, 3, 4)])[0]
    assert segment_keys(canonicalize([P(1, 2), D(3, 4)]))[0] == plain
    after_span = segment_keys([P(1, 2), S(9), D(3, 4)])[2]
    assert after_span.extra_key != plain.extra_key


def test_span_key_ignores_what_precedes_it():
    a = segment_keys([P(1), S(7, 8)])[1]
    b = segment_keys([P(2, 3), S(4), S(7, 8)])[2]
    assert a == b


@pytest.mark.parametrize(
    "left, right",
    [
        ([P(1, 2), S(3)], [P(1), S(2, 3)]),  # same tokens, different boundary
        ([S(1), S(2)], [S(1, 2)]),  # one span vs two
        ([P(1), S(2)], [S(1), S(2)]),  # prefix vs span of the same tokens
        ([P(1), S(2), D(3), S(4)], [P(1), S(2), S(3), S(4)]),  # pdep vs span
        ([P(1), S(2)], [P(1), S(3)]),
        ([P(1), S(2)], [P(1), S(2), S(2)]),
    ],
)
def test_pdep_keys_differ_when_anything_before_differs(left, right):
    assert segment_keys(left + [D(5)])[-1] != segment_keys(right + [D(5)])[-1]


def test_pdep_keys_equal_when_everything_before_matches():
    assert segment_keys([P(1), S(2), D(5)])[-1] == segment_keys([P(1), S(2), D(5)])[-1]


def test_segment_keys_needs_canonical_input():
    with pytest.raises(ValueError, match="canonical"):
        segment_keys([P(1), D(2)])
    with pytest.raises(ValueError, match="canonical"):
        segment_keys([P(), S(2)])


# ---- tail_key -----------------------------------------------------------------------------------------------------
def test_tail_extends_prefix_or_pdep_and_opens_pdep_after_span():
    assert tail_key([P(1, 2)], (9,)) == RadixKey((1, 2, 9), None)
    segs = [P(1), S(2), D(3)]
    assert tail_key(segs, (9,)) == RadixKey((3, 9), segment_keys(segs)[-1].extra_key)
    assert tail_key([P(1), S(2)], (9,)) == RadixKey((9,), pdep_namespace([P(1), S(2)]))
    assert tail_key([P(1), S(2)], ()).extra_key == pdep_namespace([P(1), S(2)])
    assert tail_key([], (9,)) == RadixKey((9,), None)


# ---- properties ---------------------------------------------------------------------------------------------------
tokens = st.lists(st.integers(0, 2), max_size=3).map(tuple)
raw_segment = st.one_of(
    st.builds(Segment, st.just("span"), tokens.filter(bool)),
    st.builds(Segment, st.just("pdep"), tokens),
)
raw_prompt = st.builds(lambda head, rest: [Segment("prefix", head)] + rest, tokens, st.lists(raw_segment, max_size=4))


@settings(max_examples=300, deadline=None)
@given(raw_prompt)
def test_canonical_form_is_idempotent_and_keeps_tokens(raw):
    canon = canonicalize(raw)
    assert canonicalize(canon) == canon
    assert [t for s in canon for t in s.token_ids] == [t for s in raw for t in s.token_ids]
    assert len(segment_keys(canon)) == len(canon)


@settings(max_examples=300, deadline=None)
@given(raw_prompt, st.lists(st.integers(0, 2), min_size=1, max_size=3))
def test_tail_key_is_the_key_of_output_appended_as_pdep(raw, extra):
    canon = canonicalize(raw)
    assert tail_key(canon, extra) == segment_keys(canonicalize(canon + [Segment("pdep", tuple(extra))]))[-1]


@settings(max_examples=300, deadline=None)
@given(raw_prompt, raw_prompt)
def test_pdep_namespaces_collide_only_for_identical_structures(a, b):
    ca, cb = canonicalize(a), canonicalize(b)
    ka = segment_keys(ca + [S(0), D(1)])[-1]
    kb = segment_keys(cb + [S(0), D(1)])[-1]
    assert (ka == kb) == (ca == cb)


# ---- recomputed runs inside spans ---------------------------------------------------------------------------------
def R(tokens: tuple[int, ...], runs, anchor: tuple[int, ...] = ()) -> Segment:
    return Segment("span", tokens, anchor, runs)


def test_runs_are_normalized_and_cut_the_span_into_pieces():
    seg = R((1, 2, 3, 4, 5, 6, 7, 8), [(6, 5), (0, 1), (1, 1), (3, 2), (4, 0)])
    assert seg.recompute == ((0, 2), (3, 2), (6, 2))
    assert seg.pieces() == [(True, 0, 2), (False, 2, 3), (True, 3, 5), (False, 5, 6), (True, 6, 8)]
    assert R((1, 2, 3), [(1, 1)]).pieces() == [(False, 0, 1), (True, 1, 2), (False, 2, 3)]


def test_a_span_recomputed_whole_is_pdep_text_counted_as_span_text():
    got = canonicalize([P(1), R((2, 3), [(0, 1), (1, 1)]), S(4), R((5,), [(0, 1)]), D(6)])
    assert got == [
        Segment("prefix", (1, 2, 3), span_runs=((1, 2),)),
        S(4),
        Segment("pdep", (5, 6), span_runs=((0, 1),)),
    ]
    assert got[0].token_ids == (1, 2, 3)  # keys ignore the runs: the same text written without markers shares them
    assert segment_keys(got)[2] == segment_keys([P(1, 2, 3), S(4), D(5, 6)])[2]


def test_runs_are_part_of_the_structure_after_the_span():
    keys = [segment_keys([P(9), R((5, 6, 7), runs), D(4)])[2] for runs in ((), ((0, 1),), ((1, 1),), ((2, 1),))]
    assert len({k.extra_key for k in keys}) == 4


@given(
    st.lists(st.integers(0, 5), min_size=2, max_size=12),
    st.lists(st.tuples(st.integers(0, 11), st.integers(1, 3)), max_size=4),
)
@settings(max_examples=200, deadline=None)
def test_a_recomputed_run_is_keyed_as_pdep_text_after_the_span_cut_before_it(tokens, runs):
    """A run attends to everything before it, exactly as PDEP text right after the span's tokens before it would:
    both get one namespace, so a cache hit equals recomputation."""
    span = R(tuple(tokens), runs, anchor=(7,))
    if span.recomputed_whole:
        return
    before = [P(9, 8), S(1, 2)]
    spaces = recompute_namespaces([*before, span, D(3)])
    assert spaces[0] == spaces[1] == spaces[3] == ()
    for (start, n), space in zip(span.recompute, spaces[2]):
        if start == 0:
            assert space == namespaces_before([*before, span])[2]
        else:
            cut = R(span.token_ids[:start], span.recompute, anchor=(7,))
            assert space == segment_keys(canonicalize([*before, cut, D(*span.token_ids[start : start + n])]))[3].extra_key
