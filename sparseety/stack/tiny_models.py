"""Tiny random-weight Hugging Face checkpoints for tests and demos, built offline.

Each checkpoint pairs a byte-level BPE tokenizer (trained on a small embedded English
text) with a 2-layer model of hidden size 128 and random bf16 weights. vLLM (CPU build)
serves it like any real checkpoint: prefix caching, speculative decoding, KV events,
MoE routing (``mixtral``), sliding-window attention (``mistral-sw``), a hybrid of full and
sliding-window layers (``gemma3-hybrid``) and chunked local attention (``llama4-chunked``) all
work, which is what the SparSEEty tests need; the generated text is noise.

Usage::

    python -m sparseety.stack.tiny_models llama /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

KINDS: Final = (
    "llama",
    "mixtral",
    "mistral-sw",
    "mixtral-sw",
    "gemma3-hybrid",
    "llama4-chunked",
    "llama-think",
    "mixtral-sw-think",
    "idefics3",
)
MARKER: Final = ".sparseety-tiny-model.json"
"""Written last; its presence means the checkpoint directory is complete."""

_FORMAT_VERSION: Final = 1
_VOCAB_SIZE: Final = 512
_SPECIAL_TOKENS: Final = ("<unk>", "<s>", "</s>", "<pad>")
#: ``llama-think``: the think delimiters of vLLM's ``deepseek_r1`` reasoning parser, added tokens
#: that are not special (they stay in the decoded text, as in DeepSeek-R1's tokenizer).
THINK_TOKENS: Final = ("<think>", "</think>")
#: ``idefics3``: the special tokens of Idefics3's processor (``<global-img>`` is a plain added
#: token there), and its image geometry: a 32-pixel image, 8-pixel patches and a pixel-shuffle
#: scale of 2 give ``(32 // 8) ** 2 // 2 ** 2 = 4`` image tokens, which the processor wraps as
#: ``<fake_token_around_image><global-img><image>*4<fake_token_around_image>`` (7 placeholders).
IDEFICS3_TOKENS: Final = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
IDEFICS3_IMAGE_SIZE: Final = 32
IDEFICS3_IMAGE_SEQ_LEN: Final = 4
#: A chat template that places an ``{"type": "image"}`` content part as ``<image>``.
_MM_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS: Final = """\
The serving fleet runs many copies of the same model behind a router. Each engine
keeps a cache of key and value blocks for the prompts it has seen, so that a new
request which shares a prefix with an earlier one can skip part of its prefill. The
scheduler decides, at every step, which requests run, how many tokens each one may
process, and which blocks are freed when memory runs short. When the cache is full,
the least recently used blocks are evicted, and a request that needs them again must
compute them a second time. Speculative decoding proposes several draft tokens at
once. The target model checks them in a single forward pass and keeps the longest
prefix it agrees with; the rest are rejected, which costs compute but produces no
output. A mixture of experts routes every token to a small number of feed-forward
experts chosen by a learned gate, so most parameters stay idle for any single token.
Sliding-window attention lets each token look back only a fixed distance, and the
blocks that fall out of the window can be released early. Accounting for all of this
is harder than counting prompt and completion tokens. A tenant who sends the same
long system prompt a thousand times pays once for the compute if the cache holds it,
and many times if it does not. Platform engineers want to know who used the
hardware, how much the cache saved, how much work was thrown away, and which experts
carried the load. Finance wants a bill per team and per key that matches what the
machines did. Good morning. How are you today? I would like a short summary of the
report, please. The weather is mild, the river is calm, and the market opens at
nine. Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024 and 2048
appear in logs, tables and invoices. Write a function that returns the sum of a
list. Explain the difference between a queue and a stack. Translate the sentence
into French. List three colours: red, green and blue. The quick brown fox jumps over
the lazy dog while the five boxing wizards jump quickly. Every request has an
identifier, an arrival time, a prompt, a set of sampling parameters and a budget of
output tokens. It waits in a queue, is admitted, runs for a number of steps, may be
preempted and resumed, and finally stops at an end token or a length limit.
"""


def build_tiny_model(kind: str, path: Path, *, seed: int = 0) -> Path:
    """Build a tiny random-weight checkpoint at ``path`` unless it is already there.

    The build happens in a temporary sibling directory that is renamed into place once
    complete, so concurrent builders never see a partial directory.

    Args:
        kind: One of ``"llama"``, ``"mixtral"`` (4 experts, top-2), ``"mistral-sw"``
            (Mistral with ``sliding_window=64``) or ``"mixtral-sw"`` (the Mixtral with a
            128-token sliding window), ``"gemma3-hybrid"`` (Gemma 3 text model with three
            layers: two with a 64-token sliding window and one with full attention, so vLLM
            forms a full and a sliding-window KV-cache group) or ``"llama4-chunked"`` (Llama 4
            text model, chunked local attention with ``attention_chunk_size=64`` in three
            layers and one full-attention NoPE layer, 4 experts top-1).
        path: Target checkpoint directory.
        seed: Seed for the random weights.

    Returns:
        ``path``, holding a complete checkpoint.

    Raises:
        ValueError: ``kind`` is unknown.
        FileExistsError: ``path`` exists but is not a complete checkpoint of this
            kind and seed.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    path = Path(path)
    identity = {"kind": kind, "seed": seed, "format": _FORMAT_VERSION}
    if _is_complete(path, identity):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp creates 0o700
    try:
        _write_checkpoint(kind, tmp, seed)
        (tmp / MARKER).write_text(json.dumps(identity) + "\n")
        try:
            tmp.rename(path)
        except OSError:
            # Another builder got there first (or something else occupies the path).
            if not _is_complete(path, identity):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _is_complete(path: Path, identity: dict[str, object]) -> bool:
    marker = path / MARKER
    if not marker.is_file():
        if path.exists():
            raise FileExistsError(f"{path} exists and is not a complete tiny model checkpoint")
        return False
    found = json.loads(marker.read_text())
    if found != identity:
        raise FileExistsError(f"{path} holds a different tiny model: {found} (wanted {identity})")
    return True


def _write_checkpoint(kind: str, out: Path, seed: int) -> None:
    import torch
    import transformers

    tokenizer = _train_tokenizer()
    if kind == "idefics3":
        _write_idefics3(tokenizer, out, seed)
        return
    if kind.endswith("-think"):  # the base kind, with THINK_TOKENS in its vocabulary
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer.save_pretrained(out)
    # transformers 5 records its backend class ("TokenizersBackend"), which transformers 4
    # cannot resolve; the generic name loads with both.
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    config: transformers.PretrainedConfig
    kind = kind.removesuffix("-think")
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
    elif kind in ("mixtral", "mixtral-sw"):
        # mixtral-sw (MoE routing and a 128-token window in one model) is the demo's model.
        config = transformers.MixtralConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128 if kind == "mixtral-sw" else None,
        )
    elif kind == "gemma3-hybrid":
        # Gemma 3 alternates sliding and full layers; 2 sliding + 1 full gives the sliding
        # groups a layer majority, so window release is visible on the request timeline.
        config = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3},
            sliding_window=64,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=64,
        )
    elif kind == "llama4-chunked":
        # Llama 4: chunked local attention in RoPE layers, full attention in the NoPE layer.
        config = transformers.Llama4TextConfig(
            **{**common, "num_hidden_layers": 4},
            intermediate_size_mlp=256,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            attention_chunk_size=64,
            no_rope_layers=[1, 1, 1, 0],
            layer_types=["chunked_attention"] * 3 + ["full_attention"],
        )
    else:
        config = transformers.MistralConfig(**common, sliding_window=64)

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)


def _write_idefics3(tokenizer: PreTrainedTokenizerFast, out: Path, seed: int) -> None:
    """A tiny random Idefics3 (SigLIP-style vision tower + Llama text model) with its processor
    (``Idefics3ImageProcessorPil``: the venv has no torchvision), no image splitting."""
    import torch
    import transformers
    from tokenizers import AddedToken
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    special = [AddedToken(t, special=True, normalized=False) for t in IDEFICS3_TOKENS]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = _MM_CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IDEFICS3_IMAGE_SIZE},
        max_image_size={"longest_edge": IDEFICS3_IMAGE_SIZE},
        do_image_splitting=False,
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IDEFICS3_IMAGE_SEQ_LEN,
        chat_template=_MM_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = transformers.Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IDEFICS3_IMAGE_SIZE,
        patch_size=8,
    )
    config = transformers.Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        scale_factor=2,
        image_token_id=int(tokenizer.convert_tokens_to_ids("<image>")),  # type: ignore[arg-type]
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model: Any = transformers.Idefics3ForConditionalGeneration(config)
    model = model.to(torch.bfloat16)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)


def _train_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    unk, bos, eos, pad = _SPECIAL_TOKENS
    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        chat_template=_CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_tiny_lora(model: Path, path: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """A LoRA adapter for the tiny ``llama``/``llama-think`` checkpoint at ``model``, written
    as PEFT writes one (``adapter_config.json``, ``adapter_model.safetensors``: q_proj and
    v_proj of every layer, random A and B), without PEFT. Rebuilt in place each call (tiny)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    out_dims = {"q_proj": heads * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out_dim in out_dims.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.02
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, path / "adapter_model.safetensors"
    )
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(out_dims),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: ``KIND PATH [--seed N]``."""
    parser = argparse.ArgumentParser(description="Build a tiny random-weight checkpoint.")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        print(build_tiny_model(args.kind, args.path, seed=args.seed))
    except FileExistsError as e:
        parser.exit(1, f"error: {e}\n")


if __name__ == "__main__":
    main()
