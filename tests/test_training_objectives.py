"""Training objectives: hand-checked small cases, and the multi-stream layout against plain forwards."""

from __future__ import annotations

import math

import pytest
import torch

from components.decoding import masks
from components.training import objectives as obj
from components.training.darl import (
    credit_weights,
    dtpo_loss,
    group_advantages,
    immediate_reward,
    lcp_fraction,
    lcp_length,
    lookahead_reward,
    net_slot_weight,
    permuted_advantages,
    sample_candidates,
)
from components.training.streams import block_stream, compose, window_stream

IGNORE = obj.IGNORE


# ----- DARL rewards, advantages, DTPO --------------------------------------------------------
def test_lcp_counts_only_the_correct_prefix():
    truth = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    draft = torch.tensor([1, 2, 3, 4, 5, 6, 0, 8])  # wrong at 7: the 8 after it does not count
    valid = torch.ones(8, dtype=torch.bool)
    assert lcp_length(draft, truth, valid).item() == 6
    assert lcp_fraction(draft, truth, valid).item() == pytest.approx(6 / 8)
    assert lcp_fraction(torch.tensor([9, 2]), torch.tensor([1, 2]), torch.ones(2, dtype=torch.bool)).item() == 0.0
    assert lcp_fraction(draft, truth, torch.zeros(8, dtype=torch.bool)).item() == 0.0


def test_reward_example_six_eighths_plus_four_sixteenths():
    """l_p = 8 candidates with 6 right; the rerun (prefix advanced by the AR token) gets its first 4
    outputs right of all w = 16: R = 6/8 + 4/16, as the authors' reward_calculator computes it."""
    slot_truth = torch.arange(10, 26)[None, :]  # w = 16 slots
    next_truth = slot_truth + 1  # what each window output predicts: the token after its input
    candidate = slot_truth.clone()
    candidate[0, 6] = 99  # pickup part: first 6 right
    candidate[0, 8:] = 0  # slots past l_p are not part of the candidate
    outputs = next_truth.clone()
    outputs[0, 4] = 99
    r1 = immediate_reward(candidate[:, None], slot_truth, torch.tensor([8]))
    r2 = lookahead_reward(outputs[:, None], next_truth, torch.tensor([8]))
    assert r1.item() == pytest.approx(6 / 8)
    assert r2.item() == pytest.approx(4 / 16)
    # The older choice scores only the l_n = 8 INIT slots of slot-aligned predictions, / l_n.
    slot_predictions = slot_truth.clone()
    slot_predictions[0, 8 + 4] = 99
    assert lookahead_reward(slot_predictions[:, None], slot_truth, torch.tensor([8]), slots="init").item() == pytest.approx(4 / 8)


def test_r2_is_normalised_by_the_window_not_the_init_slots():
    """Fails if r2 divides by l_n (our older choice) instead of w (the authors')."""
    next_truth = torch.arange(1, 9)[None, :]  # w = 8
    outputs = next_truth.clone()
    outputs[0, 5] = 0
    assert lookahead_reward(outputs[:, None], next_truth, torch.tensor([3])).item() == pytest.approx(5 / 8)
    slot_predictions = next_truth.clone()
    slot_predictions[0, 5] = 0  # l_p = 3: INIT slots are 3..7, LCP there = 2 of 5
    assert lookahead_reward(slot_predictions[:, None], next_truth, torch.tensor([3]), slots="init").item() == pytest.approx(2 / 5)


def test_group_advantages_are_standardised_per_sample():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards, eps=1e-4)
    std = math.sqrt(1 / 3)  # unbiased std of {1, 0, 0, 1}
    a = 0.5 / (std + 1e-4)
    assert adv[0].tolist() == pytest.approx([a, -a, -a, a])
    assert adv[1].abs().max().item() == 0.0  # identical rewards: no preference


def test_dtpo_gradient_is_minus_advantage_over_tokens_and_candidates():
    logp = torch.log(torch.tensor([[[0.5, 0.25, 0.9], [0.1, 0.2, 0.9]]])).requires_grad_(True)  # B=1, K=2, w=3
    advantages = torch.tensor([[1.0, -1.0]])
    candidates = torch.tensor([[[1, 2, 0], [3, 4, 0]]])  # slot 2 is an INIT slot
    credited = credit_weights(candidates, torch.tensor([[1, 2, 3]]), torch.tensor([2]), "pickup")
    loss = dtpo_loss(logp, advantages, credited)
    assert loss.item() == pytest.approx(0.0)  # ratio is 1 in value; advantages sum to 0
    loss.sum().backward()
    expected = torch.tensor([[[-1 / (2 * 2), -1 / (2 * 2), 0.0], [1 / (2 * 2), 1 / (2 * 2), 0.0]]])
    assert torch.allclose(logp.grad, expected)


def test_dtpo_without_pickup_is_zero_but_keeps_the_graph():
    logp = torch.zeros(1, 4, 3, requires_grad=True)
    loss = dtpo_loss(logp, torch.randn(1, 4), torch.zeros(1, 4, 3))
    loss.sum().backward()
    assert loss.item() == 0.0 and logp.grad is not None and logp.grad.abs().sum() == 0


def test_lcp_credit_stops_after_each_candidates_first_wrong_token():
    truth = torch.tensor([[5, 6, 7, 8]])
    candidates = torch.tensor([[[5, 6, 7, 8], [5, 9, 7, 8], [9, 6, 7, 8]]])  # right, wrong at 1, wrong at 0
    n_pickup = torch.tensor([3])  # slot 3 is an <INIT> slot
    lcp = credit_weights(candidates, truth, n_pickup, "lcp") * 3
    assert lcp[0].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]]
    assert (credit_weights(candidates, truth, n_pickup, "pickup") * 3)[0].tolist() == [[1, 1, 1, 0]] * 3
    # The gradient follows the credit: tokens after a candidate's first error get none.
    logp = torch.zeros(1, 3, 4, requires_grad=True)
    dtpo_loss(logp, torch.tensor([[1.0, -0.5, -0.5]]), lcp).sum().backward()
    assert (logp.grad[0, 1, 2:] == 0).all() and (logp.grad[0, 2, 1:] == 0).all() and (logp.grad[0, 1, :2] != 0).all()


def _default_credit() -> str:
    from components.training.config import DarlSection

    return DarlSection().credit


@pytest.mark.parametrize(("credit", "zero_sum"),
                         [("pickup", True), ("lcp", True), ("lcp_per_candidate", False), (_default_credit(), True)])
def test_tokens_every_candidate_shares_get_no_net_weight(credit, zero_sum):
    """Fails if the credit's normaliser differs per candidate: a token all candidates share would
    then be pushed up or down by DTPO although no candidate is preferred for it."""
    truth = torch.tensor([[5, 6, 7, 8, 9]])
    # All share slots 0-1 (right); candidate 0 is right through slot 3, 1 wrong at 2, 2 wrong at 3.
    candidates = torch.tensor([[[5, 6, 7, 8, 0], [5, 6, 1, 8, 0], [5, 6, 7, 2, 0]]])
    n_pickup = torch.tensor([4])
    advantages = group_advantages(immediate_reward(candidates, truth, n_pickup))
    net = net_slot_weight(advantages, credit_weights(candidates, truth, n_pickup, credit))
    shared = net[0, :2].abs().max().item()
    assert (shared < 1e-6) == zero_sum, net


def test_permuted_advantages_keep_each_groups_values_and_lose_their_order():
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5]]).repeat(64, 1)
    shuffled = permuted_advantages(advantages, torch.Generator().manual_seed(0))
    assert torch.equal(shuffled.sort(dim=-1).values, advantages.sort(dim=-1).values)
    assert (shuffled != advantages).any(dim=-1).float().mean() > 0.8


def test_edit_reward_scores_partial_windows_where_lcp_gives_nothing():
    truth = torch.tensor([[5, 6, 7, 8]])
    candidates = torch.tensor([[[9, 6, 7, 8], [9, 9, 9, 9]]])
    r1_lcp = immediate_reward(candidates, truth, torch.tensor([4]), "lcp")
    r1_edit = immediate_reward(candidates, truth, torch.tensor([4]), "edit")
    assert r1_lcp[0].tolist() == [0.0, 0.0] and r1_edit[0].tolist() == pytest.approx([0.75, 0.0])


def test_candidates_greedy_first_then_distinct_samples():
    logits = torch.full((1, 4, 6), -5.0)
    logits[0, torch.arange(4), torch.tensor([1, 2, 3, 4])] = 5.0
    logits[0, :, 5] = 4.5  # a strong second choice makes distinct samples easy
    generator = torch.Generator().manual_seed(0)
    cands = sample_candidates(logits, torch.tensor([3]), 4, 1.2, fill_id=0, max_retries=50, generator=generator)
    assert cands.shape == (1, 4, 4)
    assert cands[0, 0].tolist() == [1, 2, 3, 0]  # greedy on the 3 pickup slots, fill after
    assert (cands[0, :, 3] == 0).all()
    assert len({tuple(c[:3].tolist()) for c in cands[0]}) == 4


def test_candidates_accept_duplicates_when_retries_run_out():
    logits = torch.tensor([[[0.0, 50.0]]])  # only one plausible token: distinct candidates impossible
    cands = sample_candidates(logits, torch.tensor([1]), 4, 1.2, fill_id=0, max_retries=3,
                              generator=torch.Generator().manual_seed(0))
    assert cands[0, :, 0].tolist() == [1, 1, 1, 1]


# ----- AR / DAR -------------------------------------------------------------------------------
def test_ar_loss_uniform_logits_is_log_vocab_and_ignores_padding():
    tokens = torch.tensor([[1, 5, 6, 2, 0, 0], [1, 7, 2, 0, 0, 0]])
    lengths = torch.tensor([4, 3])
    logits = torch.zeros(2, 6, 10)
    assert obj.ar_loss(logits, tokens, lengths).tolist() == pytest.approx([math.log(10)] * 2)
    logits[0, 0, 5] = logits[0, 1, 6] = logits[0, 2, 2] = 100.0  # perfect on the 3 real targets of row 0
    logits[0, 3:, :] = torch.randn(3, 10) * 10  # outputs past <eos> must not matter
    assert obj.ar_loss(logits, tokens, lengths)[0].item() == pytest.approx(0.0, abs=1e-6)


def test_extended_targets_pad_finished_with_eos_and_truncated_with_ignore():
    tokens = torch.tensor([[1, 5, 2, 0], [1, 5, 6, 7]])
    out = obj.extended_targets(tokens, torch.tensor([3, 4]), torch.tensor([True, False]), eos_id=2, total=6)
    assert out.tolist() == [[1, 5, 2, 2, 2, 2], [1, 5, 6, 7, IGNORE, IGNORE]]


def test_window_plan_keeps_at_least_one_init_and_offsets_before_eos():
    lengths = torch.tensor([5, 40, 2])
    for seed in range(20):
        plan = obj.sample_window_plan(lengths, 16, torch.Generator().manual_seed(seed))
        assert ((plan.n_new >= 1) & (plan.n_new <= 16)).all()
        assert (plan.offsets <= lengths - 2).all() and (plan.offsets >= 0).all()


def test_dar_loss_covers_sequence_start_through_window_only():
    vocab, n_clean, width = 12, 8, 3
    tokens = torch.tensor([[1, 3, 4, 5, 6, 7, 8, 2]])
    truth = obj.extended_targets(tokens, torch.tensor([8]), torch.tensor([True]), 2, n_clean + width + 2)
    plan = obj.WindowPlan(offsets=torch.tensor([2]), n_pickup=torch.tensor([1]), window=width)
    clean = torch.zeros(1, n_clean, vocab)
    window = torch.zeros(1, width, vocab)
    for i in range(3):  # clean outputs 0..c=2 predict tokens 1..3
        clean[0, i, truth[0, i + 1]] = 50.0
    for j in range(width):  # slot j (token c+1+j) predicts token c+2+j
        window[0, j, truth[0, 2 + 2 + j]] = 50.0
    perfect = obj.dar_loss(clean, window, truth, plan).item()
    assert perfect == pytest.approx(0.0, abs=1e-6)
    clean[0, 5] = torch.randn(vocab) * 20  # a clean output after c: not part of the DAR loss
    assert obj.dar_loss(clean, window, truth, plan).item() == pytest.approx(perfect, abs=1e-6)
    window[0, 2] = 0.0  # the last window output is: loss = log(V) / (3 + 3) positions
    assert obj.dar_loss(clean, window, truth, plan).item() == pytest.approx(math.log(vocab) / 6, rel=1e-4)


def test_window_inputs_and_slot_logits_follow_the_ar_shift():
    plan = obj.WindowPlan(offsets=torch.tensor([1, 3]), n_pickup=torch.tensor([2, 0]), window=3)
    drafts = torch.tensor([[7, 8, 9], [7, 8, 9]])
    assert obj.window_inputs(plan, drafts, init_id=4).tolist() == [[7, 8, 4], [4, 4, 4]]
    clean = torch.arange(2 * 5).float().reshape(2, 5, 1)
    window = 100 + torch.arange(2 * 3).float().reshape(2, 3, 1)
    slots = obj.slot_logits(clean, window, plan)[..., 0]
    assert slots.tolist() == [[1.0, 100.0, 101.0], [8.0, 103.0, 104.0]]


# ----- block diffusion / CSL -------------------------------------------------------------------
def _truth(lengths: list[int], width: int, block: int, finished: bool = True) -> torch.Tensor:
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.arange(10, 10 + n)
        tokens[row, 0], tokens[row, n - 1] = 1, 2
    return obj.block_truth(tokens, torch.tensor(lengths), torch.tensor([finished] * len(lengths)), 2, block)


def test_block_truth_pads_eos_to_the_end_of_the_eos_block():
    truth = _truth([5], width=9, block=4)  # n = 12; eos at 4 lies in block 1 (4..7)
    assert truth[0].tolist() == [1, 11, 12, 13, 2, 2, 2, 2, 2, IGNORE, IGNORE, IGNORE, IGNORE]


def test_mineru_never_masks_block_start_and_supervises_masked_targets_and_block_ends():
    truth = _truth([30, 17], width=32, block=8)
    blocks = obj.mineru_noisy_block(truth, 8, mask_id=5, generator=torch.Generator().manual_seed(0))
    inputs, loss = blocks.input_ids, blocks.loss_mask
    assert (inputs[:, ::8] != 5).all()
    masked = inputs == 5
    for b in range(2):
        for j in range(32):
            in_block_next = (j % 8 != 7) and masked[b, j + 1] and truth[b, j + 1] != IGNORE
            block_end = j % 8 == 7 and truth[b, j + 1] != IGNORE
            assert loss[b, j].item() == bool(in_block_next or block_end), (b, j)
    assert (blocks.targets[loss] != IGNORE).all()
    assert not loss[1, 24:].any()  # the second row ends in block 2: block 3 has no targets


def test_pabdm_masks_a_right_suffix_and_supervises_from_the_cut():
    truth = _truth([33], width=33, block=8)[:, : 33]  # exactly 4 blocks + next token
    blocks = obj.pabdm_noisy_block(truth, 8, mask_id=5, generator=torch.Generator().manual_seed(3))
    masked = (blocks.input_ids == 5).reshape(4, 8)
    loss = blocks.loss_mask.reshape(4, 8)
    for block in range(4):
        cut = int((~masked[block]).sum())
        assert 1 <= cut <= 7
        assert masked[block].tolist() == [False] * cut + [True] * (8 - cut)
        assert loss[block].tolist() == [False] * (cut - 1) + [True] * (9 - cut)


def test_csl_gate_supervises_through_the_first_unconfident_target():
    gold = torch.tensor([[0.95, 0.50, 0.99, 0.20, 0.99, 0.97, 0.96, 0.91]])
    loss_mask = torch.tensor([[True, True, True, True, False, True, True, True]])
    gate = obj.csl_gate(gold, loss_mask, block_length=4, tau=0.9)
    assert gate.int().tolist() == [[1, 1, 0, 0, 0, 1, 1, 1]]


def test_csl_loss_ignores_targets_after_the_gate():
    blocks = obj.NoisyBlocks(
        input_ids=torch.zeros(1, 4, dtype=torch.long), targets=torch.tensor([[1, 2, 3, 0]]),
        loss_mask=torch.tensor([[True, True, True, True]]), block_length=4,
    )
    logits = torch.full((1, 4, 4), -20.0)
    logits[0, 0, 1] = 20.0  # confident and right
    logits[0, 1, :] = 0.0  # unconfident: supervised, closes the gate
    logits[0, 2, 0] = 20.0  # confidently wrong, but after the gate
    loss, kept = obj.pabdm_csl_loss(logits, blocks, tau=0.9)
    assert kept.item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(math.log(4) / 2, rel=1e-4)


def test_consistency_weights():
    weights = obj.consistency_weights(torch.tensor([0.2, 1.0, float("nan")]), beta=1.0)
    assert weights.tolist() == pytest.approx([1.8, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        obj.consistency_weights(torch.tensor([1.5]), beta=1.0)


# ----- the multi-stream layout equals separate forwards -------------------------------------
@pytest.fixture(scope="module")
def tiny(tokenizer):
    from models.loading import new_tiny_model

    model = new_tiny_model(tokenizer, seed=0)
    torch.manual_seed(1)
    pixels = torch.randn(2, 1, *model.config.image_size)
    with torch.no_grad():
        prefix = model.encode_images(pixels)
    return model, prefix


def _plain_causal_logits(model, prefix, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, prefix=prefix)["logits"]


def test_block_stream_mask_is_the_decoders_two_stream_mask():
    clean = torch.zeros(3, 16, dtype=torch.long)
    for pattern in masks.PATTERNS:
        layout = compose(clean, [block_stream("noisy", clean.clone(), 4, pattern)], n_prefix=5)
        assert torch.equal(layout.attention_mask, masks.expand(masks.two_stream(5, 16, 4, pattern), 3))
        assert layout.position_ids[0].tolist() == list(range(5 + 16)) + list(range(5, 5 + 16))


def test_window_stream_logits_equal_a_plain_causal_forward(tiny):
    model, prefix = tiny
    torch.manual_seed(2)
    clean = torch.randint(6, 300, (2, 12))
    offsets = torch.tensor([3, 7])
    window = torch.randint(6, 300, (2, 4))
    decoy = block_stream("decoy", torch.randint(6, 300, (2, 12)), 4, "bidirectional")  # must not leak
    layout = compose(clean, [window_stream("w", window, offsets), decoy], prefix.embeds.shape[1])
    with torch.no_grad():
        logits = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                       position_ids=layout.position_ids, prefix=prefix)["logits"]
    reference_clean = _plain_causal_logits(model, prefix, clean)
    assert torch.allclose(layout.clean_logits(logits), reference_clean, atol=1e-4)
    for row in range(2):
        o = int(offsets[row])
        sequence = torch.cat([clean[row, : o + 1], window[row]])[None]
        single = type(prefix)(embeds=prefix.embeds[row : row + 1])
        reference = _plain_causal_logits(model, single, sequence)[0, o + 1 :]
        assert torch.allclose(layout.stream_logits(logits, "w")[row], reference, atol=1e-4)


def test_causal_block_stream_logits_equal_a_plain_forward_per_block(tiny):
    model, prefix = tiny
    torch.manual_seed(3)
    clean = torch.randint(6, 300, (2, 8))
    noisy = torch.randint(6, 300, (2, 8))
    layout = compose(clean, [block_stream("p", noisy, 4, "causal")], prefix.embeds.shape[1])
    with torch.no_grad():
        logits = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                       position_ids=layout.position_ids, prefix=prefix)["logits"]
    stream = layout.stream_logits(logits, "p")
    # block 1 (positions 4..7) must equal a causal forward over [clean 0..3, noisy 4..7]
    reference = _plain_causal_logits(model, prefix, torch.cat([clean[:, :4], noisy[:, 4:]], dim=1))[:, 4:]
    assert torch.allclose(stream[:, 4:], reference, atol=1e-4)


# ----- the mix module ---------------------------------------------------------------------------
def _two_page_batch(tokenizer, model, max_tokens: int):
    """A training batch of synthetic pages 1 and 2, padded to the longer one."""
    from components.data.synthetic import generate_page
    from components.training.data import Batch, encode_markup

    pages = [generate_page(seed) for seed in (1, 2)]
    encoded = [encode_markup(tokenizer, page.markup, max_tokens) for page, _ in pages]
    tokens = torch.full((2, max(len(ids) for ids, _ in encoded)), tokenizer.pad_token_id)
    for row, (ids, _) in enumerate(encoded):
        tokens[row, : len(ids)] = torch.tensor(ids)
    return Batch(
        pages=model.preprocess([image for _, image in pages]), tokens=tokens,
        lengths=torch.tensor([len(ids) for ids, _ in encoded]), ends_with_eos=torch.tensor([f for _, f in encoded]),
        weights=torch.ones(2), page_ids=["a", "b"],
    )


@pytest.mark.parametrize(
    ("objectives", "dar"),
    [
        ({"ar": 1.0}, {}),
        ({"dar": 1.0}, {"draft": "gt"}),
        ({"dar": 1.0}, {"draft": "model"}),
        ({"darl": 1.0}, {"window": 6}),
        ({"block_diffusion": 1.0}, {}),
        ({"pabdm_csl": 1.0}, {}),
    ],
)
def test_every_objective_trains_the_whole_model(tokenizer, objectives, dar):
    from components.training.config import parse_train_config
    from components.training.mix import ObjectiveMix
    from models.loading import new_tiny_model

    model = new_tiny_model(tokenizer, seed=0).train()
    config = parse_train_config({
        "name": "t", "output_dir": "var/unused", "deepspeed": "configs/deepspeed/zero0.json",
        "model": {"bootstrap": {}}, "data": {"dataset": "var/unused", "max_tokens": 48}, "objectives": objectives,
        "dar": dar, "train": {"steps": 1},
    })
    batch = _two_page_batch(tokenizer, model, 48)
    loss, metrics = ObjectiveMix(model, config)(batch, torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and loss.item() > 0
    assert all(f"loss_{name}" in metrics for name in objectives)
    loss.backward()
    for part in ("vision", "projector", "language_model.model.layers.3", "language_model.model.embed_tokens"):
        grads = [p.grad for n, p in model.named_parameters() if n.startswith(part)]
        assert grads and all(g is not None for g in grads), part
        assert sum(g.abs().sum() for g in grads) > 0, part


# ----- DARL wiring: each test fails when one link of OMTG -> rewards -> DTPO is broken ----------------
def _darl_config(dtpo_coef: float, temperature: float, **darl):
    from components.training.config import parse_train_config

    return parse_train_config({
        "name": "t", "output_dir": "var/unused", "deepspeed": "configs/deepspeed/zero0.json",
        "model": {"bootstrap": {}}, "data": {"dataset": "var/unused", "max_tokens": 40},
        "objectives": {"darl": 1.0}, "dar": {"window": 6},
        "darl": {"dtpo_coef": dtpo_coef, "temperature": temperature, **darl}, "train": {"steps": 1},
    })


def _darl_setup(tokenizer, monkeypatch, *, dtpo_coef: float = 1.0, temperature: float = 0.7, **darl):
    from components.training.mix import ObjectiveMix
    from models.loading import new_tiny_model

    model = new_tiny_model(tokenizer, seed=0).eval()  # eval: no dropout, so runs compare exactly
    config = _darl_config(dtpo_coef, temperature, **darl)
    batch = _two_page_batch(tokenizer, model, 40)
    # Both samples get 3 pickup slots, so DTPO has candidates to act on.
    monkeypatch.setattr(obj, "sample_window_plan", lambda lengths, window, generator=None: obj.WindowPlan(
        offsets=torch.tensor([2, 5]), n_pickup=torch.tensor([3, 3]), window=window))
    return model, ObjectiveMix(model, config), batch


def _gradient(model, mix, batch) -> torch.Tensor:
    model.zero_grad()
    loss, metrics = mix(batch, torch.Generator().manual_seed(0))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), metrics


def test_dtpo_gradient_reaches_the_model(tokenizer, monkeypatch):
    """Fails if DTPO's log-probs are detached: with fixed non-zero advantages, turning DTPO on
    must change the gradient."""
    import components.training.mix as mix_module

    monkeypatch.setattr(mix_module, "group_advantages",
                        lambda rewards, eps=1e-4: torch.tensor([[1.0, -1.0, 0.5, -0.5]]).expand_as(rewards))
    model, with_dtpo, batch = _darl_setup(tokenizer, monkeypatch, dtpo_coef=1.0)
    grad_on, metrics = _gradient(model, with_dtpo, batch)
    _, without, _ = _darl_setup(tokenizer, monkeypatch, dtpo_coef=0.0)
    without.model = model
    grad_off, _ = _gradient(model, without, batch)
    assert (grad_on - grad_off).abs().max() > 1e-6
    assert metrics["dtpo_objective"].item() != 0.0
    # An untrained model gets every candidate wrong: all rewards equal, nothing for DTPO to prefer.
    assert metrics["dtpo_zero_advantage"].item() == 1.0


def test_candidate_sampling_uses_the_configured_temperature(tokenizer, monkeypatch):
    """Fails if the DARL temperature never reaches the sampler."""
    import components.training.mix as mix_module

    seen: list[float] = []
    real = mix_module.sample_candidates

    def recording(logits, n_pickup, n_candidates, temperature, *args, **kwargs):
        seen.append(temperature)
        return real(logits, n_pickup, n_candidates, temperature, *args, **kwargs)

    monkeypatch.setattr(mix_module, "sample_candidates", recording)
    _, mix, batch = _darl_setup(tokenizer, monkeypatch, temperature=0.37)
    mix(batch, torch.Generator().manual_seed(0))
    assert seen == [0.37]
    # And the sampler really uses it: near-zero temperature gives the greedy tokens only.
    logits = torch.tensor([[[0.0, 1.0, 0.9], [0.0, 0.8, 1.0]]])
    cold = sample_candidates(logits, torch.tensor([2]), 3, 1e-3, fill_id=0, max_retries=5,
                             generator=torch.Generator().manual_seed(0))
    assert all(c.tolist() == [1, 2] for c in cold[0])
    hot = sample_candidates(logits, torch.tensor([2]), 3, 50.0, fill_id=0, max_retries=50,
                            generator=torch.Generator().manual_seed(0))
    assert len({tuple(c.tolist()) for c in hot[0]}) == 3


def _recorded_step(tokenizer, monkeypatch, **darl):
    """One DARL step of the tiny model with its DTPO internals recorded, and the page prefix."""
    model, mix, batch = _darl_setup(tokenizer, monkeypatch, temperature=5.0, **darl)
    mix.record = {}
    mix(batch, torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefix = model.encode_pages(batch.pages)
    return model, mix, batch, prefix, mix.record


COMMITTED = (2, 5)  # _darl_setup's window offsets; 3 pickup slots in a window of 6


def test_look_ahead_reward_reads_each_candidate_after_the_ground_truth_ar_token(tokenizer, monkeypatch):
    """Fails if r2's rerun ignores the candidates or the prefix advance: its predictions for
    candidate k must equal a plain causal forward over [sequence up to c, the true x_{c+1},
    candidate k's window], all w outputs."""
    import components.training.mix as mix_module

    captured = {}
    real = mix_module.lookahead_reward

    def capturing(predictions, truth, n_pickup, *rest):
        captured.update(predictions=predictions)
        return real(predictions, truth, n_pickup, *rest)

    monkeypatch.setattr(mix_module, "lookahead_reward", capturing)
    model, mix, batch, prefix, record = _recorded_step(tokenizer, monkeypatch)
    candidates, predictions = record["candidates"], captured["predictions"]
    init = tokenizer.convert_tokens_to_ids("<INIT>")
    assert len({tuple(c.tolist()) for c in candidates[0]}) > 1  # the candidates really differ
    for b, committed in enumerate(COMMITTED):
        for k in range(candidates.shape[1]):
            window = torch.where(torch.arange(6) < 3, candidates[b, k], init)
            ids = torch.cat([batch.tokens[b, : committed + 2], window])[None]
            logits = mix._ban(_plain_causal_logits(model, _row_prefix(prefix, b), ids))[0]
            expected = logits[committed + 2 : committed + 2 + 6].argmax(-1)
            assert predictions[b, k].tolist() == expected.tolist(), (b, k)


@pytest.mark.parametrize("context", ["init", "candidate"])
def test_dtpo_log_probs_come_from_the_configured_context(tokenizer, monkeypatch, context):
    """Fails if DTPO reads the wrong distribution: with ``init`` (the default, the authors'), the
    candidate tokens' log-probs are those of [sequence up to c, <INIT> x w], the context they were
    drawn from; with ``candidate``, of [sequence up to c+1, candidate k] (what SDB verifies)."""
    model, mix, batch, prefix, record = _recorded_step(tokenizer, monkeypatch, policy_context=context)
    candidates, logp = record["candidates"], record["policy_logp"]
    init = tokenizer.convert_tokens_to_ids("<INIT>")
    for b, committed in enumerate(COMMITTED):
        for k in range(candidates.shape[1]):
            if context == "init":  # <INIT> outputs at c+1.. predict x_{c+2}..
                ids = torch.cat([batch.tokens[b, : committed + 1], torch.full((6,), init)])[None]
            else:  # after the true x_{c+1}: output at c+1 predicts x_{c+2} (slot 0), then the candidate's
                ids = torch.cat([batch.tokens[b, : committed + 2], candidates[b, k]])[None]
            logits = mix._ban(_plain_causal_logits(model, _row_prefix(prefix, b), ids))[0]
            slots = logits[committed + 1 : committed + 4].log_softmax(-1)  # 3 pickup slots
            expected = slots.gather(-1, candidates[b, k, :3, None]).squeeze(-1)
            assert torch.allclose(logp[b, k, :3], expected, atol=1e-4), (b, k)


def test_the_ar_token_is_never_a_candidate(tokenizer, monkeypatch):
    """Fails if the AR slot is scored and credited (our older ``ar_slot: score``): the greedy
    candidate is the <INIT> outputs' argmax for x_{c+2}.., never the committed token's output."""
    model, mix, batch, prefix, record = _recorded_step(tokenizer, monkeypatch)
    init = tokenizer.convert_tokens_to_ids("<INIT>")
    for b, committed in enumerate(COMMITTED):
        ids = torch.cat([batch.tokens[b, : committed + 1], torch.full((6,), init)])[None]
        logits = mix._ban(_plain_causal_logits(model, _row_prefix(prefix, b), ids))[0]
        assert record["candidates"][b, 0, :3].tolist() == logits[committed + 1 : committed + 4].argmax(-1).tolist()
        assert (record["credit"][b, :, 3:] == 0).all()  # and nothing past the pickup part is credited


def test_default_dtpo_does_not_train_the_ar_distribution(tokenizer, monkeypatch):
    """Fails if credited log-probs equal the clean pass's (AR) log-probs of the same tokens under the
    default context, i.e. if DTPO moves the verifier instead of the drafter. Under the older
    ``candidate`` context they are equal wherever the candidate's earlier tokens are right."""
    for darl, equal in (({}, False), ({"policy_context": "candidate"}, True)):
        *_, record = _recorded_step(tokenizer, monkeypatch, **darl)
        gap = (record["policy_logp"] - record["clean_logp"])[record["ground_truth_context"]].abs()
        assert gap.numel() > 0 and bool(gap.max() < 1e-4) == equal, darl


def test_left_alignment_puts_each_draft_one_slot_before_its_token(tokenizer, monkeypatch):
    """``draft_alignment: left`` (the authors' DAR input): the DAR stream holds candidate 0 right
    after the committed token c, without x_{c+1}."""
    import components.training.mix as mix_module

    seen = []
    real = mix_module.window_stream
    monkeypatch.setattr(mix_module, "window_stream", lambda name, ids, offsets: seen.append((name, ids, offsets))
                        or real(name, ids, offsets))
    _recorded_step(tokenizer, monkeypatch, draft_alignment="left")
    streams = {name: (ids, offsets) for name, ids, offsets in seen}
    assert streams["dar_left"][1].tolist() == list(COMMITTED)
    assert streams["candidate0"][1].tolist() == [c + 1 for c in COMMITTED]
    assert torch.equal(streams["dar_left"][0], streams["candidate0"][0])


def _row_prefix(prefix, row: int):
    from models.interface import PagePrefix

    return PagePrefix(embeds=prefix.embeds[row : row + 1])


def test_chunked_ce_equals_plain_ce_in_value_and_gradient():
    from components.training.objectives import token_ce

    torch.manual_seed(0)
    logits = torch.randn(3, 50, 97, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 97, (3, 50))
    plain = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    chunked = token_ce(logits, targets, chunk=16)  # 150 positions in 10 checkpointed chunks
    assert torch.allclose(chunked, plain, atol=1e-6)
    (grad_plain,) = torch.autograd.grad((plain * torch.arange(50)).sum(), logits)
    (grad_chunked,) = torch.autograd.grad((chunked * torch.arange(50)).sum(), logits)
    assert torch.equal(grad_chunked, grad_plain)


def test_chunked_ce_keeps_no_fp32_copy_of_all_logits_for_backward():
    from components.training.objectives import token_ce

    logits = torch.randn(2, 64, 101, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 101, (2, 64))
    saved_fp32 = []

    def pack(tensor):
        if tensor.dtype == torch.float32:
            saved_fp32.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = token_ce(logits, targets, chunk=16).sum()
    assert sum(saved_fp32) < 16 * 101  # without per-chunk recomputation: 128 x 101 fp32 kept
    loss.backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape


def test_the_darl_ablation_script_trains_and_benchmarks_its_rows(tmp_path):
    """``benchmarks.darl_ablation`` end to end at a toy size: each row trains from the base,
    SDB is benchmarked against AR on held-out pages, and a second run reuses the finished rows."""
    import json

    from benchmarks.darl_ablation import main

    argv = ["--rows", "ar,immediate", "--seeds", "0", "--steps", "2", "--train-pages", "8", "--eval-pages", "2",
            "--max-new-tokens", "12", "--no-mlflow", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "darl_ablation.json").read_text())["rows"]
    assert rows["immediate"]["same_as_ar"]["median"] == 1.0  # greedy SDB = greedy AR
    assert "zero_advantage" in rows["immediate"] and "zero_advantage" not in rows["ar"]
    trained = (tmp_path / "runs" / "immediate-seed0" / "model" / "training_meta.json").stat().st_mtime
    assert main(argv) == 0 and (tmp_path / "runs" / "immediate-seed0" / "model" / "training_meta.json").stat().st_mtime == trained


def test_the_dtpo_probe_separates_dtpo_gradient_from_dar(tokenizer, monkeypatch):
    """The probe's DTPO gradient is the difference of two identical-draw runs: non-zero when the
    advantages are, zero when every candidate scored alike."""
    import components.training.mix as mix_module
    from components.training.probe import dtpo_gradient_probe

    model, _, batch = _darl_setup(tokenizer, monkeypatch)
    config = _darl_config(dtpo_coef=0.1, temperature=0.7)
    flat = dtpo_gradient_probe(model, config, batch)
    assert flat["grad_ratio"] == 0.0 and flat["zero_advantage"] == 1.0  # untrained: all candidates wrong
    monkeypatch.setattr(mix_module, "group_advantages",
                        lambda rewards, eps=1e-4: torch.tensor([[1.0, -1.0, 0.5, -0.5]]).expand_as(rewards))
    probe = dtpo_gradient_probe(model, config, batch)
    assert probe["grad_ratio"] > 0.0 and -1.0 <= probe["grad_cosine"] <= 1.0
