"""Build the tiny local Llama that tests and demos serve (no hub is reachable).

The model is a 2-layer Llama (hidden 128, head_dim 32, 4 heads, 2 KV heads, bf16) with random
weights and a byte-level BPE tokenizer trained on a generated word corpus. Output text is
gibberish; greedy token ids are deterministic, which is what tests compare. Everything is seeded:
two builds with the same seed are byte-identical (weights, tokenizer, configs).

Command line: ``lmcache-p2p tiny-model DIR [--seed N]`` through :func:`add_parser` / :func:`run`,
or standalone ``python -m lmcache_p2p.cli.tiny_model DIR``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

VOCAB_SIZE = 430
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITION_EMBEDDINGS = 4096
WEIGHT_STD = 0.2
CORPUS_WORDS = 20_000

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, PAD_TOKEN]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The files a complete model folder holds; the marker is written last.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
COMPLETE_MARKER = ".tiny-model-complete"

_SYLLABLES = [
    c + v
    for c in ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "sh", "th")
    for v in ("a", "e", "i", "o", "u", "ai", "ou")
]


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished build (all files plus the completion marker)."""
    return (model_dir / COMPLETE_MARKER).is_file() and all((model_dir / f).is_file() for f in REQUIRED_FILES)


def build_tiny_model(out_dir: Path, *, seed: int = 0, weight_seed: int | None = None,
                     weight_std: float = WEIGHT_STD) -> Path:
    """Build the tiny Llama into ``out_dir`` and return it; reuse a complete build already there.

    ``seed`` drives the tokenizer corpus and, unless ``weight_seed`` is given, the weights: the same
    ``seed`` with another ``weight_seed`` is a different model with the same tokenizer (so the same
    chunk hashes). ``weight_std`` 0.02 gives near-tied logits (the std 0.2 default is sharp).

    The build happens in a temporary sibling folder that is renamed into place, so a reader never
    sees a half-written model and two concurrent builders do not corrupt each other.
    """
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        logger.debug("tiny model already built at %s", out_dir)
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and holds no complete tiny model: remove it first")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp_dir.chmod(0o755)
        _write_model(tmp_dir, seed=seed, weight_seed=seed if weight_seed is None else weight_seed,
                     weight_std=weight_std)
        _publish(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("tiny model ready at %s (seed %d)", out_dir, seed)
    return out_dir


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    """Move a finished build into place; if another builder won the race, keep theirs."""
    if out_dir.exists() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    try:
        os.replace(tmp_dir, out_dir)
    except OSError:
        if not is_complete(out_dir):
            raise


def _write_model(model_dir: Path, *, seed: int, weight_seed: int, weight_std: float) -> None:
    tokenizer = _train_tokenizer(seed)
    tokenizer.save_pretrained(model_dir)
    model = _random_model(len(tokenizer), tokenizer, seed=weight_seed, std=weight_std)
    model.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / COMPLETE_MARKER).write_text(f"seed={seed} weight_seed={weight_seed} weight_std={weight_std:g}\n")


def _word_corpus(seed: int) -> list[str]:
    """Lines of pseudo-words made of syllables; deterministic for a seed."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(CORPUS_WORDS)]
    return [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]


def _train_tokenizer(seed: int):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_word_corpus(seed), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _random_model(vocab_size: int, tokenizer, *, seed: int, std: float = WEIGHT_STD):  # -> LlamaForCausalLM
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * std)
    return model.to(torch.bfloat16)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``tiny-model`` on the ``lmcache-p2p`` command; the handler is ``args.func``."""
    parser = subparsers.add_parser("tiny-model", help="build the tiny local Llama used by tests and demos")
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="folder to build the model into (reused if complete)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and tokenizer corpus (default 0)")
    parser.add_argument("--weight-seed", type=int, default=None,
                        help="another seed for the weights only: a different model, same tokenizer (default: --seed)")
    parser.add_argument("--weight-std", type=float, default=WEIGHT_STD,
                        help=f"std of the random weights; 0.02 gives near-tied logits (default {WEIGHT_STD})")


def run(args: argparse.Namespace) -> int:
    """Handle parsed ``tiny-model`` arguments; print the model folder; return the exit code."""
    if args.weight_std <= 0:
        raise SystemExit(f"--weight-std must be positive, got {args.weight_std}")
    model_dir = build_tiny_model(args.dir, seed=args.seed, weight_seed=args.weight_seed, weight_std=args.weight_std)
    print(model_dir)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m lmcache_p2p.cli.tiny_model DIR [--seed N]``."""
    parser = argparse.ArgumentParser(prog="lmcache-p2p tiny-model", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
