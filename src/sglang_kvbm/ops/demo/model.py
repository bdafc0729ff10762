"""A random-weight GPT-2 made locally, so demos and tests need no model hub.

GPT-2 runs on stock SGLang on CPU without any stand-in module (Llama-style
models need vLLM's rotary kernel). The tokenizer is a word-level one over
``w0 .. wN``, so a prompt is just space-separated words and every word is one
token. Weights are float32: on CPUs without bf16 instructions, bf16 matmuls
run two orders of magnitude slower.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelShape:
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    vocab_size: int = 4096
    n_positions: int = 4096


# Prefill of ~2000 tokens costs seconds on a 2-core CPU, a device hit well under one.
DEMO = ModelShape(n_embd=1024, n_layer=2, n_head=16, n_inner=4096)
# Small enough that a test server answers in a fraction of a second.
TEST = ModelShape(n_embd=256, n_layer=2, n_head=4, n_inner=1024, n_positions=2048)
# For comparisons against a reference (benchmarks/chaos.py): more heads and layers spread each
# step's attention over more past tokens, so greedy output moves when a few tokens' KV do.
# Measured in process (8 greedy tokens after 300-token prompts, 40 prompts): one token's KV
# replaced by another's changes the output of 48% of them (TEST: 15%), four tokens' 90% (52%),
# one 16-token page's 100% (90%), FP8-rounded KV 100% (85%); 1e-6 relative noise none.
CHAOS = ModelShape(n_embd=256, n_layer=4, n_head=16, n_inner=1024, n_positions=2048)

_STAMP = "sglang_kvbm_model.json"


def make_model(out_dir: str | Path, shape: ModelShape = TEST, seed: int = 0) -> Path:
    """Write a GPT-2 checkpoint and tokenizer to ``out_dir`` (reused if already there)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    out = Path(out_dir)
    stamp = out / _STAMP
    wanted = json.dumps({"shape": dataclasses.asdict(shape), "seed": seed}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)

    eos = shape.vocab_size - 1
    vocab = {f"w{i}": i for i in range(shape.vocab_size - 2)}
    vocab["<unk>"] = shape.vocab_size - 2
    vocab["<|endoftext|>"] = eos
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=shape.vocab_size,
        n_positions=shape.n_positions,
        n_embd=shape.n_embd,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_inner=shape.n_inner,
        bos_token_id=eos,
        eos_token_id=eos,
        # Wider init than GPT-2's 0.02 so greedy decoding of a random model does
        # not collapse onto one token: outputs that vary catch more bugs.
        initializer_range=0.2,
    )
    GPT2LMHeadModel(config).save_pretrained(out)
    stamp.write_text(wanted)
    return out


def prompt_ids(seed: int, length: int, vocab_size: int = TEST.vocab_size) -> list[int]:
    """Deterministic pseudo-random token ids (never EOS or unk)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(0, vocab_size - 2) for _ in range(length)]
