"""Tiny random-weight models for real SGLang servers, made here from a seed (no download).

``llama``: a GQA Llama (2 layers, hidden 64, 4 attention heads / 2 KV heads, bf16).
``deepseek_v2``: an MLA DeepSeek-V2 (kv_lora_rank 32, rope head dim 16, every layer dense,
yarn rope scaling of factor 1, bf16). Each comes with a byte-level BPE tokenizer trained on a
few lines of text, and is saved with ``save_pretrained`` as SGLang and transformers load it.

As a script: ``python tiny_models.py OUT_DIR [llama|deepseek_v2 ...]`` writes
``OUT_DIR/<name>`` for each model (both by default) and prints the paths.
"""

from __future__ import annotations

import functools
import os
import sys

MODELS = ("llama", "deepseek_v2")
SEED = 20261202
# The longest sequence (prompt + output) the models accept; the TTFT measurement uses most of it.
MAX_POSITIONS = 4096

_TEXT = [
    "The prefill server computes the key and value cache of a prompt.",
    "The decode server receives that cache and generates one token after another.",
    "Pages of sixteen tokens are written into the decode server's pool.",
    "A bootstrap server tells the decode where the prefill listens.",
    "Every byte is bounds checked before it moves over the network.",
    "Latent attention stores one compressed vector per token and layer.",
    "Grouped query attention shares each key and value head between several query heads.",
    "Small random models are enough to compare tokens exactly.",
]


def _tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on ``_TEXT`` (deterministic), as transformers'
    ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _config(
    name: str, vocab_size: int, tokenizer, head_dim: int = 16, layers: int = 2, kv_heads: int = 2, latent: tuple = (32, 16)
):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if name == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, num_key_value_heads=kv_heads, head_dim=head_dim)
    if name == "deepseek_v2":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(
            **common,
            num_key_value_heads=4,
            kv_lora_rank=latent[0],
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=latent[1],
            v_head_dim=16,
            # Every layer dense: transformers' MoE path needs fields (scoring_func) its
            # DeepseekV2Config lacks, and MLA is what the KV transfer is about.
            first_k_dense_replace=2,
            moe_layer_freq=1,  # read by SGLang's layer builder (not a transformers field)
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            # SGLang's CPU rope for DeepSeek accepts only its yarn variant; factor 1 leaves
            # the positions as they are.
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 1.0,
                "original_max_position_embeddings": MAX_POSITIONS,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(MODELS)}")


def make(
    name: str, out_dir: str, seed: int = SEED, head_dim: int = 16, layers: int = 2, kv_heads: int = 2, latent: tuple = (32, 16)
) -> str:
    """Writes model ``name`` (config, bf16 random weights from ``seed``, tokenizer) into
    ``out_dir/name``; returns that path. The same seed gives the same files. ``head_dim``
    sets the Llama's attention head size (vLLM's CPU attention refuses 16; 32 works);
    ``layers`` and the Llama's ``kv_heads`` size the KV (larger for benchmarks); ``latent`` is
    DeepSeek-V2's ``(kv_lora_rank, qk_rope_head_dim)`` (vLLM's CPU MLA takes only 512 + 64)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = os.path.join(out_dir, name)
    tokenizer = _tokenizer()
    config = _config(name, len(tokenizer), tokenizer, head_dim, layers, kv_heads, latent)
    torch.manual_seed(seed)
    # Bigger than the default 0.02 so that the tiny models' greedy choices depend visibly on
    # every layer's KV (the damaged-KV control relies on that).
    config.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=None)
def _load(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def greedy_mismatches(path: str, prompt: list[int], tokens: list[int], ulps: int = 2) -> list[str]:
    """transformers' opinion of a server's greedy ``tokens`` after ``prompt``: one forward
    pass over both (teacher forcing), and for each step whose token is not transformers'
    greedy choice by more than bf16 rounding, a line saying so. ``[]`` means every token is
    transformers' choice.

    Why not compare with ``generate`` token for token: the models are bf16, and two top logits
    equal in bf16 (which happens within 16 steps of random models) are broken by summation
    order, which differs between SGLang's kernels and transformers'. Past such a tie the two
    sequences are both right and differ. Within bf16 rounding means a gap of at most ``ulps``
    units in the last place of the top logit (bf16 keeps 8 significant bits); kernels that sum
    in another order again (another TP size, MLA's absorbed weights) need a few more."""
    import math

    import torch

    model = _load(path)
    with torch.no_grad():
        x = torch.tensor([list(prompt) + list(tokens[:-1])], dtype=torch.long)
        logits = model(x).logits[0, len(prompt) - 1 :].float()
    problems = []
    for k, (row, tok) in enumerate(zip(logits, tokens)):
        top, choice = row.max().item(), int(row.argmax())
        ulp = 2.0 ** (math.floor(math.log2(abs(top) or 1.0)) - 7)
        if top - row[tok].item() > ulps * ulp:
            problems.append(
                f"step {k}: token {tok} (logit {row[tok].item():.4f}), transformers' greedy "
                f"choice {choice} (logit {top:.4f})"
            )
    return problems


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    out_dir, names = argv[0], argv[1:] or list(MODELS)
    for name in names:
        print(make(name, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
