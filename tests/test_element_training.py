"""Training on elements (``data.unit: element``): examples, crops and task prompts, and every
family training on crops and reading them back in element mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.data.markup import BLOCK_CATEGORIES, render_block
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement, load_image
from components.data.synthetic import generate_dataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.parsing import make_layout, parse_pages
from components.parsing.prompts import task_prompt
from components.training.config import load_train_config
from components.training.data import collate, load_examples
from components.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> Path:
    return generate_dataset(tmp_path_factory.mktemp("elements") / "pages", 3, seed=21).root


def _body(page) -> list[LayoutElement]:
    return [e for e in page.elements if e.category in BLOCK_CATEGORIES]


def test_every_body_element_is_one_example_with_its_markup_and_box(pages, tokenizer):
    store = PageDataset(pages)
    examples = load_examples(pages, tokenizer, 128, unit="element")
    expected = [(p.page_id, e) for p in store.pages() for e in _body(p)]
    assert len(examples) == len(expected) > 3
    for example, (page_id, element) in zip(examples, expected, strict=True):
        assert example.page_id == page_id and example.box == element.bbox and example.category == element.category
        text = tokenizer.decode(example.token_ids, skip_special_tokens=True)
        assert text == render_block(element.category, element.content)
    batch = collate([examples[0], examples[1]], tokenizer.pad_token_id, 0.0, lambda images: images)
    x0, y0, x1, y1 = examples[0].box
    crop = batch.pages[0]
    assert abs(crop.width - (x1 - x0)) <= 6 and abs(crop.height - (y1 - y0)) <= 6  # native size plus margin


def test_elements_without_content_or_pixels_are_dropped_with_a_count(pages, tokenizer, tmp_path, capsys):
    store = PageDataset(tmp_path / "pages")
    page = PageDataset(pages).pages()[0]
    page.image = str((pages / page.image).resolve())
    body = _body(page)
    page.elements = [*body, LayoutElement("text", body[0].bbox, ""), LayoutElement("text", (5000, 5000, 5100, 5040), "x")]
    page.meta["element_consistency"] = [0.5] * len(page.elements)
    store.write([page])
    examples = load_examples(store.root, tokenizer, 128, unit="element")
    assert len(examples) == len(body)
    assert examples.prepare()["dropped_elements"] == 2
    assert "dropped 2 element(s)" in capsys.readouterr().out
    assert {e.consistency for e in examples} == {0.5}


def test_a_family_with_task_prompts_gets_its_categorys_prompt_in_training(pages, tokenizer, tmp_path):
    from recipes.tiny_checkpoint import write_tiny

    folder = write_tiny("paddleocr_vl", tmp_path / "paddle", n_texts=40)
    engine = DecodingEngine.from_pretrained(folder)
    examples = load_examples(pages, engine.tokenizer, 128, unit="element")
    table = next(e for e in examples if e.category == "table")
    text = next(e for e in examples if e.category == "text")
    batch = collate([table, text], engine.tokenizer.pad_token_id, 0.0, engine.model.cpu_preprocessor(), "paddleocr_vl")
    rendered = [engine.tokenizer.decode(ids) for ids in batch.pages["input_ids"]]
    assert "Table Recognition:" in rendered[0] and "OCR:" in rendered[1] and "OCR:" not in rendered[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "paddleocr_vl"])
def test_a_tiny_family_trains_three_steps_on_elements_and_parses_pages_with_its_prompts(family, pages, tmp_path):
    from recipes.tiny_checkpoint import write_tiny

    folder = write_tiny(family, tmp_path / "base", n_texts=40)
    config = load_train_config(ROOT / "configs/train/quick.yaml", {
        "name": "elements", "output_dir": str(tmp_path / "out"), "data.dataset": str(pages), "model.bootstrap": None,
        "model.init_from": str(folder), "objectives": {"ar": 1.0, "darl": 1.0}, "train.steps": 3,
        "train.micro_batch_size": 2, "data.max_tokens": 40, "data.unit": "element", "dar.window": 6,
        "deepspeed": "configs/deepspeed/zero1.json"})
    result = run_training(config)
    assert result.final_step == 3
    engine = DecodingEngine.from_pretrained(result.model_dir)
    store = PageDataset(pages)
    page = store.pages()[0]
    seen = []
    original = engine.generate
    engine.generate = lambda crops, params, prompts=None: seen.append(prompts) or original(crops, params, prompts=prompts)
    [parsed] = parse_pages([load_image(pages / page.image)], engine, make_layout("ground-truth"),
                           DecodeParams(max_new_tokens=8), [page])
    assert len(parsed.decoded) == len(_body(page)) and not any(e.error for e in parsed.elements)
    style = "paddleocr_vl" if family == "paddleocr_vl" else "mineru"  # Qwen2.5-VL: MinerU2.5's prompts
    assert seen == [[task_prompt(style, e.category) for e in _body(page)]]
