"""A byte-level stand-in with the tokenizer interface the inference and chat code relies on.

ids 0..255 are bytes; then <|endoftext|>, <|im_start|>, <|im_end|>, <|pad|>. ``encode`` never yields special ids.
"""

from __future__ import annotations

import json
from pathlib import Path


class ByteTokenizer:
    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

    def __init__(self):
        self.eos_id, self.im_start_id, self.im_end_id, self.pad_id = 256, 257, 258, 259
        self.vocab_size = 260

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special:
                out.append(self.SPECIALS[i - 256])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes in decoded text (specials: empty), for constrained decoding."""
        return [bytes([i]) for i in range(256)] + [b""] * len(self.SPECIALS)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [self.im_start_id] + self.encode(f"{m['role']}\n{m['content']}") + [self.im_end_id]
            ids += self.encode("\n")
        if add_generation_prompt:
            ids += [self.im_start_id] + self.encode("assistant\n")
        return ids

    def save(self, directory) -> None:
        Path(directory, "standin_tokenizer.json").write_text(json.dumps({"kind": "bytes"}))


def tiny_model_config(**overrides):
    from zero2all.config import ModelConfig, OpsConfig

    fields = dict(vocab_size=260, hidden_dim=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                  max_seq_len=128, ops=OpsConfig.plain())
    fields.update(overrides)
    return ModelConfig(**fields)
