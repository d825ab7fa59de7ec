"""Continuous batching: rows that join a running batch decode exactly what they decode alone."""

from __future__ import annotations

import threading

import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from components.data.synthetic import SyntheticConfig, generate_page
from components.decoding.engine import DecodingEngine
from components.decoding.scheduler import (
    CancelledError,
    ContinuousScheduler,
    DeadlineExceededError,
    QueueFullError,
    ScheduledEngine,
)
from components.decoding.types import DecodeParams
from components.parsing import ParseSettings, read_pages
from models.loading import new_tiny_model

DECODERS = ["ar", "sdb", "block", "ppc"]


@pytest.fixture(scope="module")
def base_engine() -> DecodingEngine:
    return DecodingEngine.from_pretrained("models/pretrained/docmarkup-base")


@pytest.fixture(scope="module")
def reader_engine() -> DecodingEngine:
    return DecodingEngine.from_pretrained("models/pretrained/docmarkup-reader")


def _pages(n: int) -> list[Image.Image]:
    return [generate_page(seed)[1] for seed in range(n)]


def _crops() -> list[Image.Image]:
    """Text crops of different lengths: the reader's prefixes differ in length from row to row."""
    font = ImageFont.load_default(size=20)
    texts = [["Continuous batching admits rows"], ["at every step,", "so a short page never waits"],
             ["for a long one."], ["Tokens stay identical", "to decoding alone", "whatever joins when."]]
    crops = []
    for lines in texts:
        image = Image.new("RGB", (max(int(font.getlength(t)) for t in lines) + 16, 30 * len(lines) + 8), "white")
        draw = ImageDraw.Draw(image)
        for i, line in enumerate(lines):
            draw.text((8, 4 + 30 * i), line, font=font, fill="black")
        crops.append(image)
    return crops


def staggered(engine: DecodingEngine, images: list[Image.Image], params: list[DecodeParams], joins: list[int],
              max_rows: int = 8):
    """Submit page i just before step ``joins[i]`` and step until all are done; their tickets."""
    scheduler = ContinuousScheduler(engine, max_rows=max_rows)
    order = sorted(range(len(images)), key=lambda i: joins[i])
    tickets: dict[int, object] = {}
    step = 0
    while len(tickets) < len(images) or not scheduler.idle:
        while order and joins[order[0]] <= step:
            i = order.pop(0)
            tickets[i] = scheduler.submit(images[i], params[i])
        scheduler.step()
        step += 1
    return [tickets[i] for i in range(len(images))], scheduler


def _assert_alone(engine, images, params, tickets) -> None:
    for image, param, ticket in zip(images, params, tickets, strict=True):
        [alone] = engine.generate([image], param)
        result = ticket.wait(0)
        assert result.token_ids == alone.token_ids
        assert result.confidences == pytest.approx(alone.confidences, abs=1e-4)
        assert result.stats.forward_passes == alone.stats.forward_passes


@pytest.mark.parametrize("decoder", DECODERS)
def test_rows_joining_mid_batch_decode_what_they_decode_alone(base_engine, decoder):
    """Pages join a batch whose other rows are 0, 3 and 9 forwards in (their prefixes land at the
    cache's tail, among other rows' speculation and holes): every page's tokens equal its own."""
    images = _pages(4)
    params = [DecodeParams(decoder=decoder, window=5, max_new_tokens=40)] * 4
    tickets, scheduler = staggered(base_engine, images, params, joins=[0, 0, 3, 9])
    assert scheduler.steps < sum(t.wait(0).stats.forward_passes for t in tickets)  # they really shared forwards
    _assert_alone(base_engine, images, params, tickets)


@pytest.mark.parametrize("decoder", ["ar", "sdb"])
def test_the_readers_rows_join_with_their_own_prefix_and_copy_prior(reader_engine, decoder):
    """The reader's prefixes differ in length and its copy prior reads each row's own slots: a row
    joining mid-batch must still be read against its own prefill."""
    images = _crops()
    params = [DecodeParams(decoder=decoder, window=4, max_new_tokens=64)] * len(images)
    tickets, _ = staggered(reader_engine, images, params, joins=[0, 2, 5, 6])
    assert len({len(t.wait(0).token_ids) for t in tickets}) > 1
    _assert_alone(reader_engine, images, params, tickets)


def test_sampled_rows_joining_late_draw_what_they_draw_alone(base_engine):
    images = _pages(3)
    params = [DecodeParams(decoder="ar", temperature=1.0, seed=s, max_new_tokens=30) for s in (11, 12, 13)]
    tickets, _ = staggered(base_engine, images, params, joins=[0, 4, 7])
    _assert_alone(base_engine, images, params, tickets)


def test_the_fixed_shape_step_admits_rows_mid_batch(base_engine):
    fixed = DecodingEngine(base_engine.model, base_engine.tokenizer, fixed_shapes=True)
    images = _pages(3)
    params = [DecodeParams(decoder="sdb", window=5, max_new_tokens=30)] * 3
    tickets, _ = staggered(fixed, images, params, joins=[0, 2, 5])
    _assert_alone(base_engine, images, params, tickets)


def test_a_cache_that_cannot_take_rows_mid_batch_admits_into_an_empty_one(base_engine):
    """The DynamicCache path (Hugging Face family adapters) waits for an empty batch: still exact."""
    dynamic = DecodingEngine(base_engine.model, base_engine.tokenizer, static_cache=False)
    images = _pages(3)
    params = [DecodeParams(decoder="ar", max_new_tokens=20)] * 3
    tickets, _ = staggered(dynamic, images, params, joins=[0, 1, 1])
    assert tickets[1].admitted >= tickets[0].result.stats.seconds + tickets[0].admitted - 1e-3
    _assert_alone(base_engine, images, params, tickets)


def test_different_parameters_decode_in_separate_batches(base_engine):
    images = _pages(2)
    params = [DecodeParams(decoder="ar", max_new_tokens=20), DecodeParams(decoder="sdb", window=4, max_new_tokens=20)]
    tickets, _ = staggered(base_engine, images, params, joins=[0, 1])
    _assert_alone(base_engine, images, params, tickets)


def test_a_row_limit_holds_pages_in_the_queue_and_compaction_keeps_tokens(base_engine):
    """Two rows at a time over six pages: every admission after the first puts a prefix at the tail and
    the slots of departed rows are squeezed out; the tokens do not change."""
    images = _pages(6)  # their markup ends after 30 to 79 tokens
    params = [DecodeParams(decoder="ar", max_new_tokens=120)] * 6
    tickets, _ = staggered(base_engine, images, params, joins=[0] * 6, max_rows=2)
    _assert_alone(base_engine, images, params, tickets)
    assert max(t.admitted for t in tickets) > min(t.admitted for t in tickets)


def test_bad_pages_cancels_and_a_full_queue_fail_only_their_own_request(base_engine):
    scheduler = ContinuousScheduler(base_engine, max_rows=4, max_waiting=3)
    good = scheduler.submit(_pages(1)[0], DecodeParams(max_new_tokens=12))
    broken = scheduler.submit(Image.new("RGB", (0, 0)), DecodeParams(max_new_tokens=12))
    too_wide = scheduler.submit(_pages(1)[0], DecodeParams(decoder="sdb", window=100_000, max_new_tokens=12))
    with pytest.raises(QueueFullError):
        scheduler.submit(_pages(1)[0], DecodeParams(max_new_tokens=12))
    scheduler.run_until_idle()
    assert good.wait(0).token_ids
    with pytest.raises(Exception, match="image"):
        broken.wait(0)
    with pytest.raises(ValueError, match="window"):
        too_wide.wait(0)
    streamed: list = []
    dropped = scheduler.submit(_pages(2)[1], DecodeParams(max_new_tokens=40),
                               on_event=lambda e: streamed.append(e) or (len(streamed) == 3 and scheduler.cancel(dropped)))
    kept = scheduler.submit(_pages(1)[0], DecodeParams(max_new_tokens=12))
    scheduler.run_until_idle()
    assert len(streamed) == 3
    with pytest.raises(CancelledError):
        dropped.wait(0)
    assert kept.wait(0).token_ids == good.wait(0).token_ids


def test_admission_counts_pages_never_the_pieces_of_accepted_pages(base_engine):
    """A dense page's forty line crops wait for rows (pieces, ``bounded=False``): the next pages
    are still admitted up to ``max_waiting`` pages, and only then refused."""
    scheduler = ContinuousScheduler(base_engine, max_rows=4, max_waiting=3)
    crop = _crops()[0]
    for _ in range(40):
        scheduler.submit(crop, DecodeParams(max_new_tokens=4), bounded=False)
    for _ in range(3):
        scheduler.submit(_pages(1)[0], DecodeParams(max_new_tokens=4))
    assert scheduler.waiting == 43 and scheduler.waiting_pages == 3
    with pytest.raises(QueueFullError, match="3 pages already wait"):
        scheduler.submit(_pages(1)[0], DecodeParams(max_new_tokens=4))


@pytest.mark.parametrize("overlap_prefill", [False, True])
def test_the_engine_loop_thread_serves_concurrent_submitters(base_engine, overlap_prefill):
    """Eight clients, four rows: pages join while others decode (with ``overlap_prefill`` their
    prefill runs on its own thread meanwhile); every page is what it is alone."""
    scheduler = ContinuousScheduler(base_engine, max_rows=4, overlap_prefill=overlap_prefill)
    scheduler.start()
    try:
        images = _pages(8)
        params = DecodeParams(decoder="sdb", window=4, max_new_tokens=60)
        results: dict[int, list[int]] = {}

        def client(i: int) -> None:
            results[i] = scheduler.submit(images[i], params).wait(60).token_ids

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert [results[i] for i in range(8)] == [r.token_ids for r in base_engine.generate(images, params)]
    finally:
        scheduler.stop()
    waiting = scheduler.submit(_pages(1)[0], DecodeParams(max_new_tokens=8))
    scheduler.stop()  # a stopped loop ends what still waits, with a reason
    with pytest.raises(CancelledError, match="stopped"):
        waiting.wait(0)


@pytest.mark.parametrize("overlap_prefill", [False, True])
def test_two_stage_parses_on_other_threads_decode_their_elements_in_the_shared_batch(base_engine, overlap_prefill):
    """The backend's element mode: each page's crops enter the running batch as rows of their own
    (``ScheduledEngine``); the parse equals the closed-batch parse of the same page."""
    settings = ParseSettings("elements", "rapid-layout")
    images = [generate_page(seed, cfg=SyntheticConfig.preset("standard"))[1] for seed in (1, 2)]
    params = DecodeParams(decoder="sdb", window=4, max_new_tokens=40)
    expected = [read_pages(base_engine, [image], params, settings)[0] for image in images]
    assert all(len(r.parse.decoded) > 1 for r in expected)
    scheduler = ContinuousScheduler(base_engine, max_rows=8, overlap_prefill=overlap_prefill)
    scheduler.start()
    try:
        shared = ScheduledEngine(scheduler, timeout=120)
        got: dict[int, object] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, read_pages(shared, [images[i]], params, settings)[0]))
                   for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        scheduler.stop()
    for i in range(2):
        assert got[i].text == expected[i].text
        assert got[i].token_ids == expected[i].token_ids


def test_a_page_past_its_own_timeout_ends_waiting_or_decoding_and_the_others_go_on(tokenizer):
    """An untrained model with large weights never writes <eos>: a 400-token page takes about a second."""
    model = new_tiny_model(tokenizer, seed=7)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 3.0 / parameter[0].numel() ** 0.5)
    scheduler = ContinuousScheduler(DecodingEngine(model, tokenizer), max_rows=2)
    first = scheduler.submit(_pages(1)[0], DecodeParams(max_new_tokens=20), timeout_s=60)
    queued = scheduler.submit(_pages(2)[1], DecodeParams(max_new_tokens=20), timeout_s=0.0)  # expires in the queue
    decoding = scheduler.submit(_pages(3)[2], DecodeParams(max_new_tokens=400), timeout_s=0.3)
    scheduler.run_until_idle()
    assert len(first.wait(0).token_ids) == 20
    with pytest.raises(DeadlineExceededError, match="waiting"):
        queued.wait(0)
    with pytest.raises(DeadlineExceededError, match="after"):  # it started, then its time ran out mid-page
        decoding.wait(0)
    assert decoding.row is not None and 0 < len(decoding.row.generated) < 400
