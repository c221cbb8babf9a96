"""Tensor-parallel sizes per role for ``lmcache-p2p launch``, and the checks that make a bad one fail
at launch, naming the flag, instead of in a server's log minutes later.

``--tp N`` sets both roles, ``--prefill-tp`` / ``--decode-tp`` one each (they win over ``--tp``). A
``--tensor-parallel-size`` among the vLLM arguments is read as ``--tp`` (the launcher then passes
each instance its own role's size). A prefiller and a decoder of different sizes pair only where one
size divides the other (each decoder rank's KV heads then come from whole sender ranks or a slice of
one); vLLM itself needs the size to divide the model's attention heads, and its KV heads to divide
the size or the size to divide them (heads replicated across ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from lmcache_p2p.errors import ConfigError

TP_FLAGS = ("--tensor-parallel-size", "-tp")


@dataclasses.dataclass(frozen=True)
class TpSizes:
    """The TP size of every prefiller and of every decoder of one launch."""

    prefill: int = 1
    decode: int = 1

    def of(self, role: str) -> int:
        return self.prefill if role == "prefiller" else self.decode

    @staticmethod
    def flag_of(role: str) -> str:
        return "--prefill-tp" if role == "prefiller" else "--decode-tp"


def positive_int(text: str) -> int:
    """argparse type for a TP size: an integer >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expects an integer >= 1, got {value}")
    return value


def add_tp_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallelism (vLLM's --tensor-parallel-size per instance)")
    g.add_argument("--tp", type=positive_int, default=None,
                   help="TP size of every instance (default 1, or a --tensor-parallel-size among the vLLM args); "
                        "on vLLM-CPU each rank gets a core, on GPUs each rank a GPU of --gpus")
    g.add_argument("--prefill-tp", type=positive_int, default=None, help="TP size of every prefiller (default --tp)")
    g.add_argument("--decode-tp", type=positive_int, default=None,
                   help="TP size of every decoder (default --tp): each rank has its own KV control port; a size "
                        "that differs from --prefill-tp must divide it or be divided by it")


def split_tp_arg(vllm_args: Sequence[str]) -> tuple[int | None, list[str]]:
    """Take ``--tensor-parallel-size`` (or ``-tp``) out of pass-through vLLM args: the launcher sets it per role."""
    rest: list[str] = []
    value: str | None = None
    it = iter(vllm_args)
    for arg in it:
        name, sep, raw = arg.partition("=")
        if name in TP_FLAGS:
            value = raw if sep else next(it, "")
        else:
            rest.append(arg)
    if value is None:
        return None, rest
    try:
        size = int(value)
    except ValueError:
        raise ConfigError("--tensor-parallel-size", f"expects an integer >= 1, got {value!r}") from None
    if size < 1:
        raise ConfigError("--tensor-parallel-size", f"expects an integer >= 1, got {size}")
    return size, rest


def tp_sizes(args: argparse.Namespace) -> TpSizes:
    """Each role's TP size from ``--prefill-tp`` / ``--decode-tp`` / ``--tp`` / a vLLM ``--tensor-parallel-size``."""
    from_vllm, _ = split_tp_arg(getattr(args, "vllm_arg", []) or [])
    both = getattr(args, "tp", None)
    if both is not None and from_vllm is not None and both != from_vllm:
        raise ConfigError("--tp", f"--tp {both} and --tensor-parallel-size {from_vllm} among the vLLM args disagree: "
                                  "give one of them")
    base = both or from_vllm or 1
    sizes = TpSizes(getattr(args, "prefill_tp", None) or base, getattr(args, "decode_tp", None) or base)
    if getattr(args, "prefill", 0) and getattr(args, "decode", 0):
        check_sizes_pair(sizes)
    return sizes


def check_sizes_pair(sizes: TpSizes) -> None:
    """A prefiller and a decoder pair only when one TP size divides the other."""
    small, large = sorted((sizes.prefill, sizes.decode))
    if large % small:
        raise ConfigError("--decode-tp", (
            f"--prefill-tp {sizes.prefill} and --decode-tp {sizes.decode}: neither divides the other, so no decoder "
            "rank's KV heads map onto whole prefiller ranks and the proxy would never pair them: choose sizes where "
            "one divides the other (e.g. 1 and 2, 2 and 4)"))


@dataclasses.dataclass(frozen=True)
class ModelHeads:
    """What of a model's config.json decides which TP sizes vLLM can serve it with (None: not stated)."""

    attention: int | None
    kv: int | None


def model_heads(model_dir: Path) -> ModelHeads:
    """The attention and KV heads of ``model_dir/config.json`` (a multimodal model's ``text_config``)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ModelHeads(None, None)
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    attention = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads", attention)
    if config.get("kv_lora_rank"):  # MLA: one latent per token, the same on every rank
        kv = None
    return ModelHeads(attention if isinstance(attention, int) else None, kv if isinstance(kv, int) else None)


def check_tp_fits_model(sizes: TpSizes, heads: ModelHeads, roles: Sequence[str] = ("prefiller", "decoder")) -> None:
    """Refuse a TP size vLLM would refuse for this model, naming the flag (only for heads the config states)."""
    for role in roles:
        size, flag = sizes.of(role), TpSizes.flag_of(role)
        if heads.attention is not None and heads.attention % size:
            raise ConfigError(flag, f"{flag} {size} does not divide the model's {heads.attention} attention heads "
                                    "(config.json num_attention_heads), which vLLM requires: choose a divisor")
        if heads.kv is not None and heads.kv % size and size % heads.kv:
            raise ConfigError(flag, f"{flag} {size} and the model's {heads.kv} KV heads (config.json "
                                    "num_key_value_heads): vLLM needs one to divide the other (a KV head split over "
                                    "ranks or replicated on several)")
