"""A long prompt tokenized in pieces gets the ids of one encode of the whole text, or is encoded whole."""

from __future__ import annotations

import random

import pytest

from lmcache_p2p.proxy.http import pieces as pieces_mod
from lmcache_p2p.proxy.http.pieces import PieceEncoder
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer

from .test_detokenize import random_dataset_prompt

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# what a cut must survive: contractions, runs and mixes of whitespace, digits, punctuation, other scripts, markup,
# special tokens' text
FRAGMENTS = ["a", "Zed", "word", "x", " ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n", "'s", "'T", "'ll", "'", "1",
             "23", "4567", ",", ".", "?!", "-", "ü", "中文", "½", "<b>", "</b>", "\ufffd", "<s>", "</s>", "<|begin_of_text|>"]


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(n))


def _llama3_style_tokenizer():
    """A Llama 3-shaped tokenizer (Split on its regex, then ByteLevel without one, BOS before the text)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(1)
    tok.train_from_iterator([_random_text(rng, 60) for _ in range(400)], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


@pytest.fixture(scope="module")
def llama3_style():
    return _llama3_style_tokenizer()


@pytest.fixture(params=["gpt2_byte_level", "llama3_split"])
def hf(request, tokenizer_dir, llama3_style):
    return tokenizer_dir[1] if request.param == "gpt2_byte_level" else llama3_style


def test_every_cut_gives_the_ids_of_the_whole_text(hf):
    """Cut at every position between an ASCII letter and a space (the most pieces there can be), with and
    without special tokens, over texts made to break a wrong cut."""
    encoder = PieceEncoder.of(hf._tokenizer, max_pieces=8)
    assert encoder is not None
    rng = random.Random(5)
    texts = [_random_text(rng, rng.randint(1, 400)) for _ in range(300)]
    texts += [hf.decode(random_dataset_prompt(hf, seed, 2000)) for seed in range(5)]  # as vllm bench makes them
    cuts = 0
    for text in texts:
        every = [0, *(m.start() + 1 for m in pieces_mod._CUT.finditer(text)), len(text)]
        cuts += len(every) - 2
        for special in (True, False):
            assert encoder._encode_cut(text, every, special) == hf.encode(text, add_special_tokens=special), text
    assert cuts > 1000


def test_a_cut_on_the_other_side_of_the_space_would_change_the_ids(hf):
    """What the tests above guard: " word" is one word, so a cut between the space and the letter (instead of
    between the letter and the space) gives other ids."""
    encoder = PieceEncoder.of(hf._tokenizer, max_pieces=8)
    text = hf.decode(random_dataset_prompt(hf, 0, 500))
    wrong = [0, *(m.start() + 1 for m in pieces_mod.re.finditer(r" [A-Za-z]", text)), len(text)]
    assert encoder._encode_cut(text, wrong, False) != hf.encode(text, add_special_tokens=False)


def test_a_long_prompt_is_tokenized_in_pieces_and_a_short_one_whole(hf, monkeypatch):
    proxy = ProxyTokenizer(hf, "test")
    proxy._pieces = PieceEncoder.of(hf._tokenizer, max_pieces=4, min_piece_chars=1000)
    batches: list[int] = []
    real = type(hf._tokenizer).encode_batch_fast
    monkeypatch.setattr(proxy, "backend", _Spy(hf._tokenizer, real, batches))
    proxy._pieces._backend = proxy.backend
    long_text = hf.decode(random_dataset_prompt(hf, 3, 5000))
    for special in (True, False):
        ids = proxy.text_prompt_ids({"prompt": long_text, "add_special_tokens": special})
        assert ids == hf.encode(long_text, add_special_tokens=special)
    assert batches == [4, 4]
    assert proxy.text_prompt_ids({"prompt": "short text"}) == hf.encode("short text")
    assert batches == [4, 4, 1]
    no_cut = "\u4e2d" * 5000  # no letter-space pair: one piece
    assert proxy.text_prompt_ids({"prompt": no_cut}) == hf.encode(no_cut)
    assert batches[-1] == 1


class _Spy:
    """A backend that records the size of each batch it encodes."""

    def __init__(self, backend, real, batches: list[int]) -> None:
        self._backend, self._real, self._batches = backend, real, batches

    def encode_batch_fast(self, texts, add_special_tokens):
        self._batches.append(len(texts))
        return self._real(self._backend, texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def _tokenizer_with(**change):
    """The Llama 3-shaped tokenizer with one part changed."""
    from tokenizers import AddedToken, normalizers, pre_tokenizers

    hf = _llama3_style_tokenizer()
    backend = hf._tokenizer
    if "normalizer" in change:
        backend.normalizer = normalizers.NFKC()
    if "metaspace" in change:
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
    if "prefix_space" in change:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    if "added" in change:
        backend.add_tokens([change["added"]] if isinstance(change["added"], AddedToken) else [change["added"]])
    return backend


@pytest.mark.parametrize("change", ["normalizer", "metaspace", "prefix_space", "added_with_space", "added_rstrip"])
def test_a_tokenizer_a_cut_could_change_is_encoded_whole(change):
    from tokenizers import AddedToken

    kwargs = {change: True}
    if change == "added_with_space":
        kwargs = {"added": "New York"}
    elif change == "added_rstrip":
        kwargs = {"added": AddedToken("xyz", rstrip=True)}
    assert PieceEncoder.of(_tokenizer_with(**kwargs), max_pieces=8) is None


def test_one_core_or_no_parallelism_encodes_whole(llama3_style, monkeypatch):
    assert PieceEncoder.of(llama3_style._tokenizer, max_pieces=1) is None
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert PieceEncoder.of(llama3_style._tokenizer, max_pieces=8) is None
