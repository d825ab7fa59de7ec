"""Task prompts per element category, in the style each model family was trained with.

PaddleOCR-VL decodes crops with ``OCR:``, ``Table Recognition:``, ``Formula Recognition:`` and
``Chart Recognition:``; MinerU2.5 (a Qwen2-VL model) with ``Text Recognition:``,
``Table Recognition:`` and ``Formula Recognition:``. Our DocVLM takes no prompt: the crop alone
says what it is, as the page says in page mode. A style is chosen per model family and can be
overridden per run (``parse.prompt_style``).
"""

from __future__ import annotations

from models.interface import ModelCapabilities, capabilities_of

PROMPT_STYLES: dict[str, dict[str, str] | None] = {
    "paddleocr_vl": {"text": "OCR:", "title": "OCR:", "code": "OCR:", "caption": "OCR:",
                     "table": "Table Recognition:", "formula": "Formula Recognition:", "chart": "Chart Recognition:"},
    "mineru": {"text": "Text Recognition:", "title": "Text Recognition:", "code": "Text Recognition:",
               "caption": "Text Recognition:", "table": "Table Recognition:", "formula": "Formula Recognition:"},
    "none": None,
}
FAMILY_STYLE = {"paddleocr_vl": "paddleocr_vl", "qwen2_vl": "mineru", "qwen2_5_vl": "mineru", "qwen3_vl": "mineru",
                "docvlm": "none"}


def prompt_style_for(family: str, override: str | None = None) -> str:
    style = override or FAMILY_STYLE.get(family, "mineru")
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; choose one of {', '.join(PROMPT_STYLES)}")
    return style


def task_prompt(style: str, category: str) -> str | None:
    """The prompt an element of ``category`` is decoded (and trained) with; None for prompt-free models."""
    prompts = PROMPT_STYLES[style]
    if prompts is None:
        return None
    return prompts.get(category, prompts["text"])


def prompt_style_of(capabilities: ModelCapabilities, override: str | None = None) -> str:
    """The task-prompt style of a model ("none" for a model that takes no prompts)."""
    if not capabilities.takes_task_prompts:
        if override not in (None, "none"):
            raise ValueError(f"prompt style {override!r} given, but this model takes no task prompts")
        return "none"
    return prompt_style_for(capabilities.family, override)


def style_for_model(model, override: str | None = None) -> str:
    """:func:`prompt_style_of` a loaded model (the trainer's, which has no engine)."""
    return prompt_style_of(capabilities_of(model), override)
