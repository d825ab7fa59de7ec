"""The real-document reader (models/reader.py): lines found in a crop, the prefix that aligns each
character's slot with the token that writes it, padding that never changes a row's output, the
objectives training it through the engine's interface, and its folder round trip."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("onnx2torch") is None:
    pytest.skip("onnx2torch is not installed (./run setup installs it)", allow_module_level=True)

from PIL import Image, ImageDraw, ImageFont


def _crop(lines: list[str], size: int = 20, indent: list[int] | None = None) -> Image.Image:
    """``lines`` in DejaVu Sans at ``size`` pixels, as an element crop at native resolution."""
    from matplotlib import font_manager

    font = ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)
    indent = indent or [0] * len(lines)
    width = max(int(font.getlength(t)) + pad for t, pad in zip(lines, indent, strict=True)) + 8
    step = int(size * 1.4)
    image = Image.new("RGB", (width, step * len(lines) + 6), "white")
    draw = ImageDraw.Draw(image)
    for i, (text, pad) in enumerate(zip(lines, indent, strict=True)):
        draw.text((4 + pad, 3 + i * step), text, font=font, fill="black")
    return image


@pytest.fixture(scope="module")
def reader():
    from models.reader import new_reader_model

    return new_reader_model(seed=0)


def test_lines_of_a_crop_are_found_top_to_bottom():
    from models.reader import find_lines

    crop = _crop(["The first line, with descenders gjpq", "Second line", "third"], indent=[0, 40, 0])
    boxes = find_lines(np.asarray(crop.convert("L")))
    assert len(boxes) == 3
    assert [b[1] for b in boxes] == sorted(b[1] for b in boxes)
    assert boxes[1][0] - boxes[0][0] >= 35  # the indented line starts further right
    assert find_lines(np.full((30, 80), 255, dtype=np.uint8)) == []


def test_each_character_slot_shares_the_position_of_the_token_that_writes_it(reader):
    """Slot 2 (after the start and the first separator) holds the first character: it must sit
    at token 0's position P, so copying is attention at relative distance 0."""
    model, _ = reader
    from models.reader import FIRST_CHARACTER_SLOT

    positions = model.prefix_positions(10, 1, "cpu")[0]
    assert positions[FIRST_CHARACTER_SLOT] == 10
    assert positions.tolist() == list(range(8, 18))


def test_the_prefix_holds_a_slot_per_character_the_tower_reads(reader):
    model, _ = reader
    crop = _crop(["Hello world"], size=24)
    prefix = model.encode_pages(model.cpu_preprocessor()([crop]))
    # start + separator + the collapsed frames + end; the frozen recogniser reads 11 characters
    assert prefix.valid.sum() == 2 + len("Hello world") + 1


def test_a_batch_decodes_each_element_as_it_decodes_alone(reader):
    """Elements of different lengths pad the shorter prefixes; the padding must stay hidden."""
    from components.decoding.engine import DecodingEngine
    from components.decoding.types import DecodeParams

    model, tokenizer = reader
    crops = [_crop(["A short one"]), _crop(["A much longer element of text", "spanning two lines here"])]
    engine = DecodingEngine(model, tokenizer)
    for decoder in ("ar", "sdb"):
        params = DecodeParams(decoder=decoder, max_new_tokens=12)
        together = engine.generate(crops, params)
        for crop, result in zip(crops, together, strict=True):
            [alone] = engine.generate([crop], params)
            assert result.token_ids == alone.token_ids, decoder


def test_every_objective_trains_the_decoder_and_never_the_tower(reader):
    from components.training.config import load_train_config
    from components.training.data import Batch
    from components.training.mix import ObjectiveMix
    from models.reader import new_reader_model

    model, tokenizer = new_reader_model(seed=1)
    config = load_train_config("configs/train/reader.yaml", [
        "objectives={ar: 1.0, dar: 0.5, block_diffusion: 0.25, pabdm_csl: 0.25}"], check_paths=False)
    mix = ObjectiveMix(model, config)
    crops = [_crop(["first element"]), _crop(["# A title"], size=30)]
    texts = ["first element", "# A title"]
    ids = [[tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
           for t in texts]
    tokens = torch.full((2, max(map(len, ids))), tokenizer.pad_token_id)
    for row, sequence in enumerate(ids):
        tokens[row, : len(sequence)] = torch.tensor(sequence)
    batch = Batch(pages=model.cpu_preprocessor()(crops), tokens=tokens, lengths=torch.tensor([len(s) for s in ids]),
                  ends_with_eos=torch.ones(2, dtype=torch.bool), weights=torch.ones(2), page_ids=["a", "b"])
    model.train()
    loss, metrics = mix(batch, torch.Generator().manual_seed(0))
    loss.backward()
    assert {"loss_ar", "loss_dar", "loss_block_diffusion", "loss_pabdm_csl"} <= set(metrics)
    assert all(p.grad is not None for p in model.parameters())
    assert all(p.grad is None and not p.requires_grad for p in model.tower.module.parameters())


def test_a_saved_reader_loads_and_decodes_the_same(reader, tmp_path):
    from components.decoding.engine import DecodingEngine
    from components.decoding.types import DecodeParams
    from models.loading import load_markup_model

    model, tokenizer = reader
    model.save_folder(tmp_path / "reader", tokenizer)
    loaded, loaded_tokenizer = load_markup_model(tmp_path / "reader")
    crop = _crop(["Round trip"])
    params = DecodeParams(max_new_tokens=8)
    assert (DecodingEngine(loaded, loaded_tokenizer).generate([crop], params)[0].token_ids
            == DecodingEngine(model, tokenizer).generate([crop], params)[0].token_ids)


def test_a_reader_refuses_another_recogniser(reader, tmp_path):
    import json

    from models.loading import load_markup_model

    model, tokenizer = reader
    folder = model.save_folder(tmp_path / "reader", tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["tower_sha256"] = "0" * 64
    (folder / "config.json").write_text(json.dumps(config))
    loaded, _ = load_markup_model(folder)
    with pytest.raises(ValueError, match="sha256 differs"):
        loaded.encode_pages(loaded.cpu_preprocessor()([_crop(["x"])]))


def test_a_character_takes_one_slot_per_byte_it_is_written_with(reader):
    """’ is three byte tokens: three slots keep every later slot beside the token that writes it."""
    from models.ocr_encoder import ppocr_charset

    model, tokenizer = reader
    charset = ppocr_charset()
    classes = torch.tensor([charset.index("a") + 1, charset.index("’") + 1, charset.index("b") + 1])
    slots = model.character_slots(classes, torch.zeros(3, model.config.feature_size + 1))
    assert slots.shape[0] == len(tokenizer("a’b", add_special_tokens=False)["input_ids"]) == 5


def test_the_reader_learns_element_text_and_the_layout_gives_its_form():
    """The reader's targets are bare content; a parse wraps its text by the layout's category."""
    from components.data.pages import LayoutElement, Page
    from components.parsing.assembly import element_markup
    from components.training.data import element_targets

    page = Page(page_id="p", image="x.png", width=200, height=200, elements=[
        LayoutElement("title", (0, 0, 100, 20), "Results"), LayoutElement("code", (0, 30, 100, 60), "x = 1")])
    assert [t for _, _, t in element_targets(page, markup=False)[0]] == ["Results", "x = 1"]
    assert [t for _, _, t in element_targets(page)[0]] == ["# Results", "```text\nx = 1\n```"]
    assert element_markup("title", "Results") == "# Results"
    assert element_markup("code", "x = 1") == "```text\nx = 1\n```"


def test_the_tower_frames_of_training_lines_are_kept_for_the_next_run(tmp_path, monkeypatch):
    """A phase or a resumed run starts with the frozen tower's frames of every line seen before."""
    import models.reader as reader_module
    from models.reader import TOWER_CACHE_ENV, new_reader_model

    monkeypatch.setenv(TOWER_CACHE_ENV, str(tmp_path / "frames.pt"))
    monkeypatch.setattr(reader_module, "CACHE_SAVE_EVERY", 1)
    monkeypatch.setattr(reader_module, "_FRAME_CACHES", {})
    model, _ = new_reader_model(seed=0)
    model.train()
    crops = [_crop(["cached line"]), _crop(["another", "two lines"])]
    first = model.encode_pages(model.cpu_preprocessor()(crops))
    assert (tmp_path / "frames.pt").is_file()
    monkeypatch.setattr(reader_module, "_FRAME_CACHES", {})  # as in a new process: only the file is left
    again, _ = new_reader_model(seed=0)
    again.train()
    assert len(reader_module.frame_cache(again.config.tower_sha256)) == 3
    monkeypatch.setattr(reader_module._Tower, "__call__", lambda *a: pytest.fail("the tower ran for a cached line"))
    second = again.encode_pages(again.cpu_preprocessor()(crops))
    assert torch.allclose(first.embeds, second.embeds, atol=1e-2)  # frames are kept in half precision


def test_reading_the_same_lines_again_runs_the_tower_once_only_when_asked(monkeypatch):
    """The annotation loop reads the same pages with one model after another: with
    keep_frames_at_inference on, a new reader on the same tower reuses the frames (and reads the
    same); off (the default, a server's case) every read runs the tower."""
    import models.reader as reader_module
    from models.reader import keep_frames_at_inference, new_reader_model

    monkeypatch.setattr(reader_module, "_FRAME_CACHES", {})
    monkeypatch.setattr(reader_module, "_KEEP_INFERENCE_FRAMES", False)
    calls = []
    real_call = reader_module._Tower.__call__
    monkeypatch.setattr(reader_module._Tower, "__call__", lambda self, lines: calls.append(len(lines)) or
                        real_call(self, lines))
    crops = [_crop(["kept frames"]), _crop(["read twice", "by two readers"])]
    first, _ = new_reader_model(seed=0)
    first.eval()
    with torch.inference_mode():
        first.encode_pages(first.cpu_preprocessor()(crops))
        first.encode_pages(first.cpu_preprocessor()(crops))
    assert sum(calls) == 6  # off: 3 lines, twice
    calls.clear()
    try:
        keep_frames_at_inference(True)
        with torch.inference_mode():
            kept = first.encode_pages(first.cpu_preprocessor()(crops))
        second, _ = new_reader_model(seed=0)
        second.eval()
        with torch.inference_mode():
            again = second.encode_pages(second.cpu_preprocessor()(crops))
        assert sum(calls) == 3  # the second reader ran no line through the tower
        assert torch.equal(kept.slot_tokens, again.slot_tokens)
        second.train()  # frames kept under inference mode feed a training step (autograd refuses inference tensors)
        second.encode_pages(second.cpu_preprocessor()(crops)).embeds.sum().backward()
    finally:
        keep_frames_at_inference(False)


def test_a_vertical_rule_beside_code_does_not_join_its_lines():
    """Line-numbered listings draw a bar down the whole crop: every row has ink, so without
    ignoring it the crop is one line."""
    from models.reader import find_lines

    crop = _crop(["1  border(ib)", "2  begin", "3    x:=f(t);", "4  end;"], size=18)
    ImageDraw.Draw(crop).line([(20, 0), (20, crop.height - 1)], fill="black", width=2)
    assert len(find_lines(np.asarray(crop.convert("L")))) == 4


def test_a_long_element_is_read_in_pieces_of_whole_lines_that_fit_the_trained_prefix(reader):
    model, _ = reader
    from models.reader import PIECE_FILL, find_lines

    lines = [f"Line number {i} of a long paragraph that goes on" for i in range(24)]
    crop = _crop(lines, size=20)
    pieces = model.reading_pieces(crop)
    assert len(pieces) > 1 and all(p.width == crop.width for p in pieces)
    found = [len(find_lines(np.asarray(p.convert("L")))) for p in pieces]
    assert sum(found) == len(lines)  # every line in exactly one piece, none cut
    for piece in pieces:  # each piece's prefix fits what training showed the model
        assert model.encode_pages(model.preprocess([piece])).valid.sum() <= model.config.max_train_slots
    short = _crop(lines[:2], size=20)
    assert model.reading_pieces(short) == [short]
    assert PIECE_FILL < 1


def test_the_engine_states_what_the_reader_declares_and_parsing_asks_the_engine(reader, curation_model_dir):
    """The model-engine contract: parsing, evaluation and serving read ``engine.capabilities``;
    the reader writes bare text, reads detected lines and long crops in pieces, takes no prompts;
    a page model (the curation base) declares none of that."""
    from components.decoding.engine import DecodingEngine
    from components.parsing.layout import make_layout
    from components.parsing.parse import reads_detected_lines
    from models.interface import ModelCapabilities

    model, tokenizer = reader
    engine = DecodingEngine(model, tokenizer)
    assert engine.capabilities == ModelCapabilities(family="docmarkup_reader", takes_task_prompts=False,
                                                    writes_markup=False, reads_text_lines=True, reads_in_pieces=True,
                                                    max_positions=engine.max_positions, prefix_length=0)
    long = _crop([f"Line {i} of a long element with text" for i in range(24)], size=20)
    assert [p.size for p in engine.reading_pieces(long)] == [p.size for p in model.reading_pieces(long)]
    assert reads_detected_lines(engine, make_layout("rapid-layout"))
    assert not reads_detected_lines(engine, make_layout("ground-truth"))
    page_engine = DecodingEngine.from_pretrained(curation_model_dir)
    page = page_engine.capabilities
    assert (page.writes_markup, page.reads_text_lines, page.reads_in_pieces) == (True, False, False)
    assert page_engine.reading_pieces(long) == [long]


def test_pieces_are_decoded_in_one_batch_and_merged_in_order(reader):
    """components.parsing.pieces: each crop's pieces come back as one result, text joined by the
    category's joiner (a newline in code), tokens and accounting added up."""
    from components.decoding.engine import DecodingEngine
    from components.decoding.types import DecodeParams
    from components.parsing.pieces import generate_in_pieces

    model, tokenizer = reader
    engine = DecodingEngine(model, tokenizer)
    long = _crop([f"Line {i} of a long element with text" for i in range(24)], size=20)
    short = _crop(["short"], size=20)
    params = DecodeParams(max_new_tokens=6)
    pieces = model.reading_pieces(long)
    alone = engine.generate(pieces, params)
    merged_long, merged_short = generate_in_pieces(engine, [long, short], params, categories=["code", "text"])
    assert merged_long.token_ids == [t for r in alone for t in r.token_ids]
    assert merged_long.text == "\n".join(t for r in alone if (t := r.text.strip("\n")).strip())
    assert merged_long.stats.forward_passes == sum(r.stats.forward_passes for r in alone)
    assert merged_short.token_ids == engine.generate([short], params)[0].token_ids


def test_a_runaway_row_stops_at_its_prefix_budget_not_at_max_new_tokens():
    """An untrained reader without the copy prior never writes <eos>: each row stops at about one
    token per prefix slot."""
    from components.decoding.engine import DecodingEngine
    from components.decoding.types import DecodeParams
    from models.reader import new_reader_model

    model, tokenizer = new_reader_model(seed=0, copy_prior=0.0)
    engine = DecodingEngine(model, tokenizer)
    crops = [_crop(["ab"], size=20), _crop(["a much longer line of text here"], size=20)]
    slots = model.encode_pages(model.preprocess(crops)).valid.sum(1).tolist()
    results = engine.generate(crops, DecodeParams(max_new_tokens=500))
    assert not any(r.finished for r in results)
    assert [len(r.token_ids) for r in results] == [count + count // 4 + 16 for count in slots]


def test_an_untrained_reader_writes_the_recognisers_reading_token_for_token(reader):
    """The copy prior: a freshly initialised reader, reading 200 real text lines the page front
    end's detector found (real documentation pages it never trained on), writes exactly the
    collapsed CTC reading of its frozen recogniser, byte token for byte token, and stops there."""
    from pathlib import Path

    from components.decoding.engine import DecodingEngine
    from components.decoding.types import DecodeParams
    from components.parsing.frontend import TextLineDetector
    from components.parsing.frontend.sources import line_crop

    model, tokenizer = reader
    detector = TextLineDetector()
    crops = []
    for path in sorted(Path(__file__).parent.joinpath("fixtures", "real_pages").glob("*.png")):
        page = Image.open(path).convert("RGB")
        crops += [line_crop(page, box) for box in detector.detect(page)]
    crops = crops[:200]
    assert len(crops) == 200
    inputs = model.preprocess(crops)
    frames = model.line_frames(inputs.lines, inputs.widths)
    expected: list[list[int]] = [[] for _ in crops]
    for (classes, _), owner in zip(frames, inputs.element.tolist(), strict=True):
        if expected[owner]:
            expected[owner].append(model.config.separator_token_id)
        expected[owner] += [int(t) for t in model.class_bytes[classes].flatten() if t >= 0]
    results = DecodingEngine(model, tokenizer).generate(crops, DecodeParams(max_new_tokens=400))
    eos = model.config.eos_token_id
    assert sum(len(e) for e in expected) > 4000  # real lines, not empty crops
    assert [r.token_ids for r in results] == [[*e, eos] for e in expected]


def test_a_reader_trains_through_the_deepspeed_trainer_and_keeps_a_learned_copy_gate(tmp_path):
    """Every parameter goes through DeepSpeed's broadcast (a 0-d gate cannot), and the trained folder
    loads with the gate it learned."""
    from pathlib import Path

    from components.training.config import load_train_config
    from components.training.trainer import run_training
    from models.loading import load_markup_model
    from models.reader import COPY_PRIOR, new_reader_model

    model, tokenizer = new_reader_model(seed=0)
    model.save_folder(tmp_path / "init", tokenizer)
    config = load_train_config("configs/train/reader.yaml", [
        f"model.init_from={tmp_path / 'init'}", f"output_dir={tmp_path / 'out'}",
        f"data.dataset={Path(__file__).parent / 'fixtures' / 'corpus_pages'}", "train.steps=2",
        "train.micro_batch_size=2", "train.save_every=null", "optim.warmup_steps=1", "data.workers=0"])
    result = run_training(config)
    trained, _ = load_markup_model(result.model_dir)
    assert trained.copy_gate.shape == (1,)
    assert float(trained.copy_gate.detach()) != COPY_PRIOR  # it trained


def test_the_copy_wins_where_the_recogniser_is_unsure_unless_the_decoder_is_surer_than_the_floor(reader):
    """``copy_floor``: where the recogniser gave its character 0.3, a decoder that prefers another
    byte by 8 logits wrote that byte (0.3 x 12 = 3.6 < 8) and so read worse than the copy on scans;
    with the floor at 1 the copy keeps its full 12 and wins; a decoder surer than that still departs."""
    import torch

    model, _ = reader
    vocab, copied, preferred = 300, 65, 66
    logits = torch.zeros(1, 1, vocab)
    logits[0, 0, preferred] = 8.0
    n_prefix = 4
    positions = torch.tensor([[n_prefix]])  # token 0 sits at the first character's slot (slot 2)
    slot_tokens = torch.tensor([[-1, -1, copied, 2]])
    unsure = torch.tensor([[1.0, 1.0, 0.3, 1.0]])
    assert model.config.copy_floor == 0.0
    assert int(model.copy_bias(logits, positions, slot_tokens, unsure).argmax()) == preferred
    model.config.copy_floor = 1.0
    try:
        assert int(model.copy_bias(logits, positions, slot_tokens, unsure).argmax()) == copied
        logits[0, 0, preferred] = 14.0  # a decoder that learned better than the copy
        assert int(model.copy_bias(logits, positions, slot_tokens, unsure).argmax()) == preferred
    finally:
        model.config.copy_floor = 0.0
