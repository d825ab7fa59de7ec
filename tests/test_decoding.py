"""The decoding loops, tested against a scripted oracle (exact expectations) and a real transformer."""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch
from PIL import Image

from components.data.pages import InvalidPageError
from components.data.synthetic import generate_page
from components.decoding import masks
from components.decoding.engine import DecodingEngine, special_ids_of
from components.decoding.ppc import confident_prefix_length
from components.decoding.types import DecodeParams, DecodeStats
from models import docvlm
from models.loading import new_tiny_model
from tests.oracle_model import OracleModel


def _targets(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    ids = special_ids_of(tokenizer)
    rng = random.Random(seed)
    content = [t for t in range(len(tokenizer)) if t not in (ids.bos, ids.eos, ids.pad, ids.init, ids.mask, tokenizer.unk_token_id)]
    return [[ids.bos, *(rng.choice(content) for _ in range(n)), ids.eos] for n in lengths]


def _oracle_engine(tokenizer, lengths, **kwargs) -> tuple[DecodingEngine, OracleModel, list[list[int]]]:
    targets = _targets(tokenizer, lengths)
    ids = special_ids_of(tokenizer)
    oracle = OracleModel(targets, len(tokenizer), placeholders=(ids.init, ids.mask, ids.pad, ids.bos), **kwargs)
    return DecodingEngine(oracle, tokenizer), oracle, targets


def _pages(n: int) -> list[Image.Image]:
    return [Image.new("RGB", (32, 32), "white") for _ in range(n)]


# ----- masks ------------------------------------------------------------------------------
def test_block_causal_mask_is_lower_triangular_over_blocks():
    mask = masks.block_causal(6, 2)
    expected = torch.tensor(
        [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_sliding_window_causal_mask_limits_lookback():
    mask = masks.sliding_window_causal(5, 2)
    assert mask[4].tolist() == [False, False, False, True, True]
    assert not mask.triu(1).any()


def test_decode_step_mask_hides_holes_and_padding_and_sets_segment_pattern():
    slot_valid = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    stored_valid = torch.tensor([[0, 1], [1, 1]], dtype=torch.bool)
    causal = masks.decode_step(slot_valid, stored_valid, 3, "causal")
    bidir = masks.decode_step(slot_valid, stored_valid, 3, "bidirectional")
    assert causal.shape == (2, 1, 5, 9)
    # Row 0: the hole at slot 2 and the padded stored slot (column 4) are invisible to everyone.
    assert not causal[0, 0, :, 2].any() and not causal[0, 0, :, 4].any()
    # Stored tokens are causal among themselves; the speculative segment sees all stored tokens.
    assert causal[1, 0, 0, 5].item() is False and causal[1, 0, 1, 4].item() is True
    assert causal[1, 0, 2:, 4:6].all()
    # Inside the segment: causal vs bidirectional.
    assert causal[1, 0, 2, 7].item() is False and bidir[1, 0, 2, 8].item() is True
    # Every query row attends to something (no NaN softmax), padding included.
    assert causal.any(dim=-1).all()


def test_two_stream_mask_matches_block_diffusion_semantics():
    n_prefix, n_tokens, block = 2, 6, 3
    mask = masks.two_stream(n_prefix, n_tokens, block, "bidirectional")
    clean0, noisy0 = n_prefix, n_prefix + n_tokens
    # Clean stream is plain causal over [prefix, tokens].
    assert torch.equal(mask[: noisy0, : noisy0], masks.causal(noisy0))
    # Noisy block 1 (tokens 3..5) sees the prefix, clean tokens 0..2 only, and itself fully.
    row = mask[noisy0 + 3]
    assert row[:n_prefix].all() and row[clean0 : clean0 + 3].all() and not row[clean0 + 3 : noisy0].any()
    assert row[noisy0 + 3 : noisy0 + 6].all() and not row[noisy0 : noisy0 + 3].any()
    causal_inner = masks.two_stream(n_prefix, n_tokens, block, "causal")
    assert causal_inner[noisy0 + 3, noisy0 + 4].item() is False and causal_inner[noisy0 + 4, noisy0 + 3].item() is True
    with pytest.raises(ValueError):
        masks.two_stream(n_prefix, n_tokens, block, "sideways")


# ----- oracle: exact behaviour of every loop ---------------------------------------------------
def test_ar_commits_one_token_per_forward(tokenizer):
    engine, oracle, targets = _oracle_engine(tokenizer, [20])
    [result] = engine.generate(_pages(1), DecodeParams(decoder="ar"))
    assert result.token_ids == targets[0][1:]
    assert result.finished and not result.truncated
    assert result.stats.forward_passes == len(targets[0]) - 1 == oracle.forward_calls
    assert result.stats.tokens_per_forward == 1.0


@pytest.mark.parametrize(("window", "horizon"), [(16, 4), (3, 6), (1, 1), (8, 8)])
def test_sdb_commits_verified_prefix_only(tokenizer, window, horizon):
    engine, _, targets = _oracle_engine(tokenizer, [60], horizon=horizon)
    [result] = engine.generate(_pages(1), DecodeParams(decoder="sdb", window=window))
    assert result.token_ids == targets[0][1:]  # never commits an unverified guess
    lengths = result.stats.accepted_lengths
    assert lengths[0] == 1  # first forward has only <INIT> placeholders: the AR token alone
    if horizon < window:
        # Guesses are right `horizon` tokens past the last committed one: that many verify each step.
        assert all(length == horizon + 1 for length in lengths[1:-1]), lengths
    else:
        # The whole window verifies (w+1 tokens); the next window is all <INIT> again, so 1 follows.
        assert lengths[1:-1] == [window + 1, 1] * ((len(lengths) - 2) // 2) + [window + 1] * (len(lengths) % 2), lengths
    assert max(lengths) <= window + 1


def test_sdb_batch_of_different_lengths_matches_single_pages(tokenizer):
    engine, _, targets = _oracle_engine(tokenizer, [5, 40, 17, 1], horizon=3)
    results = engine.generate(_pages(4), DecodeParams(decoder="sdb", window=6))
    assert [r.token_ids for r in results] == [t[1:] for t in targets]
    assert all(r.finished for r in results)


@pytest.mark.parametrize("decoder", ["ar", "sdb", "ppc", "block"])
def test_budget_stops_cleanly_with_truncated_flag(tokenizer, decoder):
    engine, _, targets = _oracle_engine(tokenizer, [50, 3])
    results = engine.generate(_pages(2), DecodeParams(decoder=decoder, max_new_tokens=10, threshold=0.96))
    long_page, short_page = results
    assert long_page.truncated and not long_page.finished and long_page.token_ids == targets[0][1:11]
    assert short_page.finished and not short_page.truncated and short_page.token_ids == targets[1][1:]


def test_model_position_limit_truncates_instead_of_crashing(tokenizer):
    engine, oracle, _ = _oracle_engine(tokenizer, [500], max_positions=80)
    [result] = engine.generate(_pages(1), DecodeParams(decoder="sdb", window=16, max_new_tokens=1000))
    assert result.truncated and not result.finished
    assert oracle.n_prefix + len(result.token_ids) + 17 <= 80


def test_ppc_commits_confident_prefix_and_resets_span(tokenizer):
    # guess(d) = 0.99, 0.97, 0.95, ...: with tau=0.96 the confident prefix is sure + 2 guesses = 3 tokens.
    engine, oracle, targets = _oracle_engine(tokenizer, [30], horizon=6)
    [result] = engine.generate(_pages(1), DecodeParams(decoder="ppc", span=8, threshold=0.96))
    assert result.token_ids == targets[0][1:]
    assert result.stats.accepted_lengths[:-1] == [3] * (len(result.stats.accepted_lengths) - 1)
    # Each forward feeds the committed-but-uncached tokens plus one fresh full span of D.
    assert set(oracle.widths[1:]) == {2 + 8}


def test_ppc_with_low_threshold_commits_wrong_guesses(tokenizer):
    engine, _, targets = _oracle_engine(tokenizer, [30], horizon=2)
    [result] = engine.generate(_pages(1), DecodeParams(decoder="ppc", span=8, threshold=0.2))
    assert result.token_ids != targets[0][1:]  # PPC is not exact: its score may drop, unlike SDB


def test_confident_prefix_length_rules():
    assert confident_prefix_length([0.99, 0.97, 0.5, 0.99], 0.95) == 2
    assert confident_prefix_length([0.4, 0.99], 0.95) == 1  # at least one token
    assert confident_prefix_length([0.99, 0.99], 0.95) == 2


@pytest.mark.parametrize(("threshold", "per_step"), [(0.96, 3), (0.999, 1), (0.9, 6)])
def test_block_decoding_commits_every_confident_mask(tokenizer, threshold, per_step):
    engine, _, targets = _oracle_engine(tokenizer, [64], horizon=10)
    [result] = engine.generate(_pages(1), DecodeParams(decoder="block", block_length=32, threshold=threshold))
    assert result.token_ids == targets[0][1:]
    body = result.stats.accepted_lengths[:-1]
    # Steps inside a block commit `per_step` tokens; a block's last step may commit fewer.
    assert max(body) == per_step and body.count(per_step) >= len(body) - 3


def test_block_decoding_stores_finished_block_in_next_forward(tokenizer):
    engine, oracle, targets = _oracle_engine(tokenizer, [70], horizon=40)
    [result] = engine.generate(_pages(1), DecodeParams(decoder="block", block_length=8, threshold=0.5))
    assert result.token_ids == targets[0][1:]
    # With every guess confident, each block takes one forward; from the second on, the previous
    # block's 8 inputs are stored in the same forward: widths 8, then 16, 16, ...
    assert oracle.widths[0] == 8 and set(oracle.widths[1:]) == {16}
    assert result.stats.forward_passes == oracle.forward_calls == -(-71 // 8)


def test_stream_yields_commits_whose_text_adds_up(tokenizer):
    engine, _, _ = _oracle_engine(tokenizer, [25, 12], horizon=3)
    params = DecodeParams(decoder="sdb", window=4)
    events = list(engine.stream(_pages(2), params))
    results = engine.generate(_pages(2), params)
    for row, result in enumerate(results):
        row_events = [e for e in events if e.row == row]
        assert "".join(e.text for e in row_events) == result.text
        assert [t for e in row_events for t in e.token_ids] == result.token_ids
        assert row_events[-1].finished and not any(e.finished for e in row_events[:-1])


def test_closing_the_stream_cancels_decoding(tokenizer):
    engine, oracle, _ = _oracle_engine(tokenizer, [200])
    stream = engine.stream(_pages(1), DecodeParams(decoder="ar"))
    for _ in range(3):
        next(stream)
    stream.close()
    assert oracle.forward_calls == 3


def test_bad_inputs_get_clear_errors(tokenizer):
    engine, _, _ = _oracle_engine(tokenizer, [5])
    with pytest.raises(InvalidPageError, match=r"zero size|too small"):
        engine.generate([Image.new("RGB", (0, 10))])
    with pytest.raises(TypeError, match="PIL image"):
        engine.generate([b"not an image"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one"):
        engine.generate([])
    with pytest.raises(ValueError, match="decoder must be one of"):
        DecodeParams(decoder="beam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold"):
        DecodeParams(threshold=1.5)


# ----- a real transformer: greedy SDB is token-identical to greedy AR -----------------------------
@pytest.fixture(scope="module")
def chaotic_engine(tokenizer) -> DecodingEngine:
    """An untrained tiny DocVLM re-initialised with large weights, so its greedy outputs vary a lot.

    (A default-initialised model repeats one token forever, which would make the check vacuous.)
    """
    model = new_tiny_model(tokenizer, seed=7)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                fan_in = parameter[0].numel()
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 3.0 / fan_in**0.5)
    return DecodingEngine(model, tokenizer)


def test_greedy_sdb_is_token_identical_to_greedy_ar_on_a_real_model(chaotic_engine):
    pages = [generate_page(seed)[1] for seed in range(3)]
    ar = chaotic_engine.generate(pages, DecodeParams(decoder="ar", max_new_tokens=48))
    assert len({tuple(r.token_ids) for r in ar}) > 1 and len(set(ar[0].token_ids)) > 5  # outputs really vary
    for window in (16, 5):
        sdb = chaotic_engine.generate(pages, DecodeParams(decoder="sdb", window=window, max_new_tokens=48))
        assert [r.token_ids for r in sdb] == [r.token_ids for r in ar]
        for page in range(len(pages)):  # batching must not change a page's output
            [alone] = chaotic_engine.generate([pages[page]], DecodeParams(decoder="sdb", window=window, max_new_tokens=48))
            assert alone.token_ids == ar[page].token_ids


@pytest.fixture(scope="module")
def base_engine() -> DecodingEngine:
    """The shipped base checkpoint: trained, so speculative decoders accept varying lengths."""
    return DecodingEngine.from_pretrained("models/pretrained/docmarkup-base")


def _assert_same_decoding(results, reference) -> None:
    """Two engines decoded the same pages alike: same tokens, confidences within 1e-5."""
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    for row, expected in zip(results, reference, strict=True):
        assert row.confidences == pytest.approx(expected.confidences, abs=1e-5)


@pytest.mark.parametrize("decoder", ["ar", "sdb", "block", "ppc"])
def test_static_kv_cache_gives_the_dynamic_caches_tokens(base_engine, decoder):
    """The lean decoder over a static cache (the default for DocVLM) is the same function as the
    transformers forward over a DynamicCache: same tokens and confidences, batched rows that
    accept different lengths (holes in the shared cache) included."""
    pages = [generate_page(seed)[1] for seed in range(3)]
    params = DecodeParams(decoder=decoder, window=5, max_new_tokens=40)
    dynamic = DecodingEngine(base_engine.model, base_engine.tokenizer, static_cache=False)
    fast = base_engine.generate(pages, params)
    _assert_same_decoding(fast, dynamic.generate(pages, params))
    if decoder == "sdb":  # rows accepted different lengths per forward, so the cache had holes
        assert len({tuple(r.stats.accepted_lengths) for r in fast}) > 1


@pytest.mark.parametrize("decoder", ["ar", "sdb", "block", "ppc"])
def test_the_fixed_shape_step_decodes_what_the_default_step_decodes(base_engine, decoder):
    """The GPU step (K/V written at a device index, attention over the whole capacity: what CUDA
    graphs and torch.compile need) is the same function: same tokens, batched rows with holes."""
    pages = [generate_page(seed)[1] for seed in range(3)]
    params = DecodeParams(decoder=decoder, window=5, max_new_tokens=40)
    fixed = DecodingEngine(base_engine.model, base_engine.tokenizer, fixed_shapes=True)
    _assert_same_decoding(fixed.generate(pages, params), base_engine.generate(pages, params))
    assert fixed._fixed_step is not None  # it really ran the fixed-shape step


def test_the_fixed_shape_step_compiles_as_one_graph(base_engine):
    """torch.compile(fullgraph=True) fails on any graph break; the eager backend checks that
    without generating code (which the GPU check does for real)."""
    from components.decoding.fixed_step import FixedShapeStep

    engine = DecodingEngine(base_engine.model, base_engine.tokenizer, fixed_shapes=True)
    lean = base_engine.model.static_decoder()
    engine._fixed_step = FixedShapeStep(lean)
    engine._fixed_step.function = torch.compile(lean.forward_fixed, fullgraph=True, dynamic=False, backend="eager")
    page = [generate_page(3)[1]]
    params = DecodeParams(decoder="ar", max_new_tokens=12)
    assert engine.generate(page, params)[0].token_ids == base_engine.generate(page, params)[0].token_ids


def test_cuda_graphs_are_refused_for_a_model_on_the_cpu(base_engine):
    with pytest.raises(ValueError, match="CUDA"):
        DecodingEngine(base_engine.model, base_engine.tokenizer, cuda_graphs=True)


def test_static_decoder_logits_equal_the_transformers_forward(chaotic_engine):
    from models.static_decoder import StaticKV

    model = chaotic_engine.model
    images = [generate_page(seed)[1] for seed in range(2)]
    _, cache = model.prefill(images, torch.zeros(2, 0, dtype=torch.long))
    n_prefix = cache.get_seq_length()
    kv = StaticKV.from_cache(cache, n_prefix + 4)  # too small on purpose: the buffers must grow
    for q_len in (1, 6):
        ids = torch.randint(5, 100, (2, q_len), generator=torch.Generator().manual_seed(q_len))
        positions = torch.arange(n_prefix, n_prefix + q_len).repeat(2, 1)
        mask = masks.decode_step(torch.ones(2, n_prefix, dtype=torch.bool), torch.zeros(2, 0, dtype=torch.bool),
                                 q_len, "causal")
        kv.length = n_prefix
        lean = model.static_decoder().forward(ids, positions, mask, kv)
        _, fresh = model.prefill(images, torch.zeros(2, 0, dtype=torch.long))
        reference = model.forward_tokens(ids, positions, mask, fresh)
        assert torch.allclose(lean, reference, atol=1e-5)
        assert kv.length == n_prefix + q_len


def test_sampling_is_reproducible_with_a_seed(chaotic_engine):
    page = [generate_page(11)[1]]
    params = DecodeParams(decoder="sdb", temperature=1.0, seed=5, max_new_tokens=32)
    first, second = chaotic_engine.generate(page, params)[0], chaotic_engine.generate(page, params)[0]
    assert first.token_ids == second.token_ids
    other = chaotic_engine.generate(page, DecodeParams(decoder="sdb", temperature=1.0, seed=6, max_new_tokens=32))[0]
    assert other.token_ids != first.token_ids


def test_text_model_never_gets_flash_attention_because_decode_masks_are_arbitrary(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert docvlm.attention_implementations("flash_attention_2") == ("flash_attention_2", "sdpa")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert docvlm.attention_implementations("flash_attention_2") == ("sdpa", "sdpa")
    assert docvlm.attention_implementations("eager") == ("eager", "eager")


@pytest.mark.parametrize("decoder", ["ar", "sdb", "block"])
def test_a_cancelled_stream_row_leaves_the_batch_and_the_others_finish(tokenizer, decoder):
    engine, oracle, targets = _oracle_engine(tokenizer, [30, 30, 12], horizon=2)
    dropped: set[int] = set()
    events_per_row = {0: 0, 1: 0, 2: 0}
    tokens = {0: [], 1: [], 2: []}
    for event in engine.stream(_pages(3), DecodeParams(decoder=decoder, window=4, block_length=8, threshold=0.5),
                               cancelled=lambda row: row in dropped):
        events_per_row[event.row] += 1
        tokens[event.row].extend(event.token_ids)
        if event.row == 1 and events_per_row[1] == 2:
            dropped.add(1)  # the client of page 1 went away after its second forward
    assert events_per_row[1] == 2  # no event (and no forward) for it after the cancel
    assert tokens[0] == targets[0][1:] and tokens[2] == targets[2][1:]
    assert oracle.forward_calls == events_per_row[0]  # the longest remaining page set the number of forwards


@pytest.mark.parametrize(("decoder", "name"), [("sdb", "window"), ("block", "block_length"), ("ppc", "span")])
def test_a_speculative_length_beyond_the_positions_names_its_parameter(tokenizer, decoder, name):
    engine = DecodingEngine(new_tiny_model(tokenizer), tokenizer)
    too_long = DecodeParams(decoder=decoder, **{name: engine.max_positions})
    with pytest.raises(ValueError, match=rf"{name} {engine.max_positions} is too large for this model"):
        engine.check_params(too_long)
    engine.check_params(DecodeParams(decoder=decoder, **{name: 4}))


def test_choosing_a_whole_forward_at_once_equals_choosing_row_by_row():
    """The engine picks every row's tokens where the logits are and moves only (B, Q) tokens and
    confidences to the host; the picks must be the ones each row would make alone."""
    import torch

    from components.decoding.sampling import choose_rows, choose_tokens
    from components.decoding.types import DecodeParams

    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0))
    banned = torch.tensor([0, 1, 2])
    for params in (DecodeParams(), DecodeParams(temperature=0.8, top_k=5)):
        rows = choose_rows(logits, params, [torch.Generator().manual_seed(i) for i in range(3)], banned)
        alone = [choose_tokens(logits[i], params, torch.Generator().manual_seed(i), banned) for i in range(3)]
        assert [r[0] for r in rows] == [a[0] for a in alone]
        assert all(abs(x - y) < 1e-6 for r, a in zip(rows, alone, strict=True) for x, y in zip(r[1], a[1], strict=True))
        assert not any(t in (0, 1, 2) for r in rows for t in r[0])


def test_unseeded_sampling_draws_the_whole_forward_on_the_device():
    """Without a seed every row is drawn at once where the logits are: top-k holds, banned ids never
    come out, a row's confidence is the probability of the token drawn, and the draws follow the
    distribution (a near-zero temperature is greedy)."""
    import torch

    from components.decoding.sampling import choose_rows
    from components.decoding.types import DecodeParams

    logits = torch.randn(4, 6, 50, generator=torch.Generator().manual_seed(1))
    banned = torch.tensor([0, 1, 2])
    rows = choose_rows(logits, DecodeParams(temperature=1.0, top_k=3), [None] * 4, banned)
    allowed = logits.index_fill(-1, banned, float("-inf")).topk(3, dim=-1).indices
    for i, (tokens, confidences) in enumerate(rows):
        assert all(t in allowed[i, q].tolist() for q, t in enumerate(tokens))
        assert all(0 < c <= 1 for c in confidences)
    cold = choose_rows(logits, DecodeParams(temperature=1e-4), [None] * 4, banned)
    greedy = choose_rows(logits, DecodeParams(), [None] * 4, banned)
    assert [r[0] for r in cold] == [r[0] for r in greedy]


def test_decode_stats_merge_adds_counts_and_times_pages_in_sequence_or_in_one_batch():
    a = DecodeStats(forward_passes=3, new_tokens=10, seconds=2.0, accepted_lengths=[4, 3, 3], confidence_sum=9.0)
    b = DecodeStats(forward_passes=2, new_tokens=4, seconds=0.5, accepted_lengths=[2, 2], confidence_sum=2.0)
    for concurrent, seconds in ((False, 2.5), (True, 2.0)):
        total = DecodeStats.merge([a, b], concurrent=concurrent)
        assert (total.forward_passes, total.new_tokens, total.seconds) == (5, 14, seconds)
        assert total.accepted_lengths == [4, 3, 3, 2, 2] and total.mean_confidence == 11.0 / 14
    assert a.accepted_lengths == [4, 3, 3]  # the parts are left as they were
