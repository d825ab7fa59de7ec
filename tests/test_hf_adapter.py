"""A real Qwen2-VL-family checkpoint (tiny, random) driven by the shared decoding engine.

The strongest check that positions (M-RoPE offsets), masks (left-padded prompts) and the KV cache
are right: the engine's greedy AR output equals Hugging Face ``generate`` token for token, for
single pages and for a batch of pages whose prompts differ in length.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

from components.data.synthetic import generate_page
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from models.hf_adapter import (
    QWEN_CHAT_TEMPLATE,
    SUPPORTED_MODEL_TYPES,
    HFLoadError,
    HFMarkupModel,
    ImagePromptProcessor,
    load_processor,
    save_tiny_hf_vlm,
)
from models.loading import ModelLoadError, load_markup_model
from models.tokenizer import INIT, MASK

N_TOKENS = 32


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [generate_page(seed)[0].markup for seed in range(40)]


@pytest.fixture(scope="module")
def pages() -> list[Image.Image]:
    """Two pages of different sizes: their prompts hold different numbers of image tokens."""
    return [generate_page(0)[1], generate_page(1)[1].crop((0, 0, 320, 200))]


@pytest.fixture(scope="module", params=list(SUPPORTED_MODEL_TYPES))
def checkpoint(request, tmp_path_factory, texts):
    return save_tiny_hf_vlm(tmp_path_factory.mktemp(request.param), texts, model_type=request.param)


@pytest.fixture(scope="module")
def engine(checkpoint) -> DecodingEngine:
    """Loaded the way users load any model, then re-initialised with large weights.

    (A default-initialised model repeats one token, which would make the comparisons vacuous.)
    """
    model, tokenizer = load_markup_model(checkpoint)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.hf.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 3.0 / parameter[0].numel() ** 0.5)
    return DecodingEngine(model, tokenizer)


def hf_greedy(engine: DecodingEngine, pages: list[Image.Image], max_new_tokens: int) -> list[list[int]]:
    """``generate`` on the same prompts, with the tokens the engine never outputs suppressed."""
    model, ids = engine.model, engine.ids
    inputs = model.page_inputs(pages)
    out = model.hf.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=ids.eos, pad_token_id=ids.pad,
        suppress_tokens=ids.banned_outputs.tolist(),
    )
    rows = []
    for row in out[:, inputs["input_ids"].shape[1] :].tolist():
        rows.append(row[: row.index(ids.eos) + 1] if ids.eos in row else row)
    return rows


def test_checkpoint_loads_with_the_tokens_the_engine_needs(checkpoint):
    model, tokenizer = load_markup_model(checkpoint)
    assert isinstance(model, HFMarkupModel)
    # Qwen chat mapping: eos ends the assistant turn, pad is <|endoftext|>, bos is <|im_start|>
    # standing in for the prompt's last token ("\n" after "assistant").
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
    assert tokenizer.convert_ids_to_tokens(model.prompt_tokens.held_back_id) == tokenizer.tokenize("\n")[0]
    for token in (INIT, MASK):
        assert token in tokenizer.all_special_tokens
    # The saved tokenizer had no <INIT>/<MASK>: embeddings grew to cover them.
    assert model.hf.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert model.hf.get_output_embeddings().weight.shape[0] == len(tokenizer)
    assert model.max_positions == 2048
    assert model.hf.config.get_text_config()._attn_implementation == "sdpa"


def test_greedy_ar_matches_hf_generate_single_and_batched(engine, pages):
    params = DecodeParams(decoder="ar", max_new_tokens=N_TOKENS)
    batch = engine.generate(pages, params)
    inputs = engine.model.page_inputs(pages)
    assert not inputs["attention_mask"].bool().all()  # the batch really is left-padded
    assert [r.token_ids for r in batch] == hf_greedy(engine, pages, N_TOKENS)
    for page, result in zip(pages, batch, strict=True):
        [alone] = engine.generate([page], params)
        assert alone.token_ids == result.token_ids == hf_greedy(engine, [page], N_TOKENS)[0]
    assert all(len(r.token_ids) >= 16 and len(set(r.token_ids)) > 5 for r in batch)  # outputs really vary
    assert batch[0].token_ids != batch[1].token_ids


def test_greedy_sdb_is_token_identical_to_greedy_ar(engine, pages):
    ar = engine.generate(pages, DecodeParams(decoder="ar", max_new_tokens=N_TOKENS))
    for window in (16, 4):
        sdb = engine.generate(pages, DecodeParams(decoder="sdb", window=window, max_new_tokens=N_TOKENS))
        assert [r.token_ids for r in sdb] == [r.token_ids for r in ar]
        [alone] = engine.generate(pages[1:], DecodeParams(decoder="sdb", window=window, max_new_tokens=N_TOKENS))
        assert alone.token_ids == ar[1].token_ids


def test_confidence_decoders_give_each_page_the_same_output_batched_or_alone(engine, pages):
    """Rows that commit different lengths leave holes in the shared cache and finish at different
    forwards (the engine then drops rows from the cache): none of it may change a row's output."""
    banned = {engine.ids.bos, engine.ids.pad, engine.ids.init, engine.ids.mask}
    runs = []
    for decoder in ("block", "ppc"):
        params = DecodeParams(decoder=decoder, max_new_tokens=N_TOKENS, block_length=8, span=8, threshold=0.3)
        batch = engine.generate(pages, params)
        assert [r.token_ids for r in batch] == [engine.generate([page], params)[0].token_ids for page in pages], decoder
        assert all(0 < len(r.token_ids) <= N_TOKENS and not banned & set(r.token_ids) for r in batch)
        runs.append(batch)
    # The situations under test really occurred: multi-token commits, and rows leaving the batch at different times.
    assert any(max(r.stats.accepted_lengths) > 1 for batch in runs for r in batch)
    assert any(batch[0].stats.forward_passes != batch[1].stats.forward_passes for batch in runs)


def test_prefill_with_prompt_ids_continues_like_the_engine(engine, pages):
    """Prompt ids given to prefill are engine ids: <bos> stands for the held-back prompt token."""
    model = engine.model
    [first_ar] = engine.generate(pages[:1], DecodeParams(decoder="ar", max_new_tokens=2))
    logits, cache = model.prefill(pages[:1], torch.tensor([[engine.ids.bos, first_ar.token_ids[0]]]))
    assert logits.shape[:2] == (1, 2)
    assert logits[0].argmax(-1).tolist() == first_ar.token_ids[:2]
    assert cache.get_seq_length() == model.page_inputs(pages[:1])["input_ids"].shape[1] + 1


def test_padded_vocabulary_is_not_resized(checkpoint):
    """Real Qwen checkpoints have more embedding rows than tokens: <INIT>/<MASK> take spare rows."""
    processor = load_processor(checkpoint, "<|image_pad|>")
    config = AutoConfig.from_pretrained(checkpoint)
    rows = len(processor.tokenizer) + 16
    config.get_text_config().vocab_size = rows
    model = HFMarkupModel(AutoModelForImageTextToText.from_config(config), processor)
    assert model.hf.get_input_embeddings().weight.shape[0] == rows
    assert processor.tokenizer.convert_tokens_to_ids(MASK) < rows


def test_fallback_processor_matches_hf_qwen2vl_processor(checkpoint, pages, monkeypatch):
    """Without torchvision, AutoProcessor cannot build Qwen2VLProcessor; our image-only one must agree with it.

    The reference is built with the video-processor type check relaxed (it is the only part that needs torchvision).
    """
    check = ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(
        ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None if arg is None else check(self, name, arg)
    )
    reference = Qwen2VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(checkpoint), tokenizer=AutoTokenizer.from_pretrained(checkpoint),
        video_processor=None, chat_template=QWEN_CHAT_TEMPLATE,
    )
    ours = ImagePromptProcessor.from_pretrained(checkpoint, "<|image_pad|>")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Convert this page to markdown."}]}]
    prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages) == prompt
    rgb = [page.convert("RGB") for page in pages]
    expected = reference(text=[prompt] * 2, images=rgb, padding=True, padding_side="left", return_tensors="pt")
    actual = ours(text=[prompt] * 2, images=rgb, padding_side="left")
    assert sorted(actual.keys()) == sorted(expected.keys())
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def test_unsupported_family_gets_a_clear_error(tmp_path):
    folder = tmp_path / "dots"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "dots_ocr"}')
    with pytest.raises(HFLoadError, match="dots_ocr"):
        load_markup_model(folder)
    (folder / "config.json").write_text('{"model_type": "llava"}')
    with pytest.raises(ModelLoadError, match="unsupported model family"):
        load_markup_model(folder)
