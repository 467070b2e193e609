"""The tiny model every engine serves, built offline, and the prompt it is given.

A Llama of 2 layers (hidden size 128, seeded random weights) and a WordLevel tokenizer trained on
``SENTENCES``: nothing is downloaded. The harness builds it once under the work folder by running
``HARNESS model`` in the engine's venv (``ensure_model``); ``make_model`` is that command.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from vllm_compat.errors import SetupError

from .environment import HARNESS, offline_env

SENTENCES = (
    "the quick brown fox jumps over a lazy dog while seven small robots paint blue red green houses",
    "near one old river under bright stars every cat sings quietly to its friend",
)


def ensure_model(python: Path, model: Path) -> Path:
    """The tiny model under ``model``, built in the engine's venv unless it is there already."""
    if not (model / "config.json").is_file():
        made = subprocess.run(
            [str(python), str(HARNESS), "model", "--out", str(model)],
            env=offline_env(),
            check=False,
        )
        if made.returncode != 0:
            raise SetupError("building the tiny model failed; see above")
    return model


def make_model(out: Path) -> None:
    """A 2-layer Llama with seeded random weights and a WordLevel tokenizer, saved offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # type: ignore[import-not-found]
    from transformers import (  # type: ignore[import-not-found]
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    words = " ".join(SENTENCES).split()
    rotations = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]", "<s>", "</s>", "[PAD]"]
    tokenizer.train_from_iterator(rotations, trainers.WordLevelTrainer(special_tokens=special))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>", pad_token="[PAD]"
    )
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    LlamaForCausalLM(config).save_pretrained(out)


def prompt() -> str:
    """150 words: nine full blocks of 16 tokens, so whole blocks are offloaded."""
    words = " ".join(SENTENCES).split()
    return " ".join((words * 8)[:150])
