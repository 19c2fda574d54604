"""Build the real-engine tier's tiny model into a Hugging Face cache folder. Runs in the vLLM engine's virtualenv.

Run as ``ENGINE_PYTHON build_model.py HF_HOME REPO_ID REVISION`` (by :mod:`pdserve_dev.realvllm.models`, never
imported by pdserve): no model can be downloaded here, so the model vLLM serves is made on the spot. A random Llama
(2 layers, hidden 128, 4 heads, 2 KV heads) and a byte-level BPE tokenizer trained on a generated corpus (~800
tokens, bos/eos, a chat template), saved with ``save_pretrained`` into the hub cache layout
``HF_HOME/hub/models--OWNER--NAME/snapshots/REVISION`` with ``refs/main`` naming the revision. With
``HF_HUB_OFFLINE=1`` vLLM then resolves ``OWNER/NAME`` from the cache exactly as it resolves a downloaded model, so
a PDService's ``model.uri: hf://OWNER/NAME`` works unchanged.

The weights are seeded, so every build gives the same model (greedy answers are comparable across engines).
Only the standard library is imported at module level: torch, transformers and tokenizers are the engine's.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 800
SEED = 20


def _corpus() -> list[str]:
    """Text that gives the tokenizer words, digits and punctuation; seeded, so the vocabulary is stable."""
    rng = random.Random(SEED)
    words = [
        "the", "a", "model", "prefill", "decode", "cache", "token", "engine", "router", "request", "prompt",
        "kernel", "block", "transfer", "latency", "throughput", "batch", "queue", "scale", "node", "pod",
    ]  # fmt: skip
    lines = []
    for _ in range(4000):
        picked = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        picked.append(str(rng.randint(0, 9999)))
        lines.append(" ".join(picked) + rng.choice([".", "!", "?", ","]))
    return lines


def _tokenizer(folder: Path) -> Any:
    tokenizers = importlib.import_module("tokenizers")
    transformers = importlib.import_module("transformers")
    model = tokenizers.models.BPE(unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    # A plain chat template: role-tagged turns, then the assistant's cue when asked for.
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


def _model(folder: Path, vocab_size: int) -> None:
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)


def build(hf_home: Path, repo_id: str, revision: str) -> Path:
    owner, name = repo_id.split("/")
    repo = hf_home / "hub" / f"models--{owner}--{name}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(snapshot)
    _model(snapshot, len(tokenizer))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def main(argv: list[str]) -> int:
    hf_home, repo_id, revision = argv
    snapshot = build(Path(hf_home), repo_id, revision)
    print(json.dumps({"snapshot": str(snapshot), "files": sorted(p.name for p in snapshot.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
