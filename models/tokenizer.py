"""A markup-aware byte-level BPE tokenizer trained locally with ``tokenizers``.

HTML tags (``<td>``, ``</tr>``, ``<td colspan="2">``), LaTeX commands (``\\frac``) and ``$$``
are isolated before BPE runs, so merges never glue a tag to the word beside it: a table cell
boundary is always a token boundary, which keeps structure tokens cheap to predict and to
verify in parallel decoding. ``<INIT>`` (DARL placeholder) and ``<MASK>`` (diffusion mask)
are special tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK, INIT, MASK = "<pad>", "<bos>", "<eos>", "<unk>", "<INIT>", "<MASK>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, INIT, MASK]

# One alternative per unit that must never be merged with its neighbours.
MARKUP_UNITS = Regex(
    r"</?[A-Za-z][A-Za-z0-9]*(?:\s+[A-Za-z-]+=\"[^\"]*\")*\s*/?>"  # HTML tags with attributes
    r"|\\[A-Za-z]+|\\."  # LaTeX commands and escaped symbols
    r"|\$\$"  # display math fences
    r"|\n+"  # line/paragraph breaks
    r"| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9<\\$]|\s+(?!\S)|\s"  # words, single digits, symbols, spaces
)


def build_untrained_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(MARKUP_UNITS, behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_markup_tokenizer(texts: Iterable[str], vocab_size: int = 1024, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast`` with our special tokens."""
    tokenizer = build_untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return wrap(tokenizer)


def wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=[INIT, MASK],
    )
    fast.model_max_length = 4096
    return fast


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    missing = [t for t in SPECIAL_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id) and t != UNK]
    if missing:
        raise ValueError(f"tokenizer at {path} lacks special tokens {missing}; it was not trained by this project")
    return tokenizer


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The ids a model config needs to know about."""
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           [("pad_token_id", PAD), ("bos_token_id", BOS), ("eos_token_id", EOS), ("init_token_id", INIT), ("mask_token_id", MASK)]}
    return ids


def all_special_ids(tokenizer) -> set[int]:
    """Ids of every special token of ``tokenizer`` (named ones and added tokens marked special):
    none of them is markup, so decoders never emit them and corrupt drafts never use them."""
    return set(tokenizer.all_special_ids) | {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
