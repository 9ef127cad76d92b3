"""The example's tokenizers: raw bytes, or a byte-level BPE (HuggingFace `tokenizers`) trained on
the training split alone and cached on disk together with the token arrays it produces.

Both map any byte string to ids and back exactly: the BPE's base vocabulary is the 256 bytes, and
bytes that are not valid UTF-8 (which the library cannot take as text) are passed as those base
tokens. `token_bytes[i]` is the length in bytes of token i, so a loss in nats per token converts to
nats per byte over the same text, comparable across tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time

import numpy as np

TOKENIZERS = ("bytes", "bpe")
VOCAB_MULTIPLE = 128  # the model's vocabulary (embedding rows) is padded to a multiple of this


def padded_vocab(vocab_size: int) -> int:
  """The model's vocabulary for a tokenizer's: rounded up to VOCAB_MULTIPLE (GEMM tiles; the extra
  rows are never a target, so training pushes their logits down)."""
  return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _byte_to_char() -> list[str]:
  """The byte-level BPE's printable stand-in for each byte (GPT-2's table, which `tokenizers`'
  ByteLevel pre-tokenizer uses): printable Latin-1 bytes stand for themselves, the others for
  code points from 256 up, in byte order."""
  keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
  chars, extra = [], 256
  for b in range(256):
    if b in keep:
      chars.append(chr(b))
    else:
      chars.append(chr(extra))
      extra += 1
  return chars


BYTE_TO_CHAR = _byte_to_char()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# Bytes that are not UTF-8 become lone surrogates under "surrogateescape".
_ESCAPED = re.compile("([\udc80-\udcff]+)")
# A newline between two printable ASCII characters: the ByteLevel pre-tokenizer's regex splits
# there whatever surrounds it, so cutting text at such points tokenizes it the same as whole.
_CUT = re.compile(r"(?<=[!-~])\n(?=[!-~])")
CHUNK_CHARS = 1 << 16


def _pieces(data: bytes):
  """(is_text, piece) runs of `data`: UTF-8 text, or a str of escaped non-UTF-8 bytes."""
  text = data.decode("utf-8", errors="surrogateescape")
  for i, piece in enumerate(_ESCAPED.split(text)):
    if piece:
      yield i % 2 == 0, piece


def _chunks(text: str, size: int = CHUNK_CHARS):
  """`text` cut into pieces of about `size` characters at tokenization-neutral points."""
  start = 0
  while start < len(text):
    m = _CUT.search(text, start + size) if start + size < len(text) else None
    end = m.end() if m else len(text)
    yield text[start:end]
    start = end


class ByteTokenizer:
  """Token i is byte i."""

  kind = "bytes"
  vocab_size = 256

  def __init__(self):
    self.token_bytes = np.ones(256, np.int32)

  def encode(self, data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.int32)

  def decode(self, ids) -> bytes:
    return bytes(np.asarray(ids, np.uint8))


class BPETokenizer:
  """A byte-level BPE: a `tokenizers.Tokenizer` (ByteLevel pre-tokenizer, no prefix space, no
  special tokens) with exact bytes-in, bytes-out encode and decode."""

  kind = "bpe"

  def __init__(self, tok):
    self.tok = tok
    vocab = tok.get_vocab()
    self.vocab_size = tok.get_vocab_size()
    self.pieces = [b""] * self.vocab_size
    for s, i in vocab.items():
      self.pieces[i] = bytes(CHAR_TO_BYTE[c] for c in s)
    self.token_bytes = np.array([len(p) for p in self.pieces], np.int32)
    self.byte_ids = np.array([vocab[c] for c in BYTE_TO_CHAR], np.int32)

  @classmethod
  def from_file(cls, path: str) -> "BPETokenizer":
    import tokenizers  # pylint: disable=import-outside-toplevel
    return cls(tokenizers.Tokenizer.from_file(path))

  def save(self, path: str):
    self.tok.save(path)

  def encode(self, data: bytes) -> np.ndarray:
    out = []
    for is_text, piece in _pieces(data):
      if is_text:
        encs = self.tok.encode_batch_fast(list(_chunks(piece)), add_special_tokens=False)
        out.extend(np.asarray(e.ids, np.int32) for e in encs)
      else:
        out.append(self.byte_ids[[ord(c) - 0xDC00 for c in piece]])
    return np.concatenate(out) if out else np.zeros(0, np.int32)

  def decode(self, ids) -> bytes:
    return b"".join(self.pieces[i] for i in np.asarray(ids).tolist())


def train_bpe(data: bytes, vocab_size: int) -> BPETokenizer:
  """A byte-level BPE of at most `vocab_size` tokens (the 256 bytes included) learned from `data`.
  Deterministic: merges are taken by count, ties broken by the pair; pairs seen once are not
  merged, so a small corpus can stop short of `vocab_size`."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  if vocab_size < 257:
    raise ValueError(f"a BPE vocabulary holds the 256 bytes and merges: got {vocab_size}")
  byte_level = tokenizers.pre_tokenizers.ByteLevel
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = byte_level(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, show_progress=False,
      initial_alphabet=byte_level.alphabet(), special_tokens=[])
  texts = [c for is_text, piece in _pieces(data) if is_text for c in _chunks(piece)]
  tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
  return BPETokenizer(tok)


def _ids_dtype(vocab_size):
  return np.uint16 if vocab_size <= 1 << 16 else np.int32


def build(kind: str, train: np.ndarray, heldout: np.ndarray, vocab_size: int | None,
          cache_dir: str):
  """(tokenizer, train ids, held-out ids, info) for the byte splits `train` and `heldout` (uint8).

  "bytes" tokenizes nothing. "bpe" trains on `train` only and tokenizes both splits, cached in
  cache_dir/bpe-<vocab>-<train bytes>-<held-out bytes>-<hash of both>/ (tokenizer.json, train.npy,
  heldout.npy, info.json): a later run on the same corpus and vocabulary loads them.
  info: what was done (path, whether it trained, seconds, vocabulary reached)."""
  if kind == "bytes":
    return ByteTokenizer(), train, heldout, dict(path=None, trained=False)
  if kind != "bpe":
    raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {kind!r}")
  digest = hashlib.sha256(train.tobytes())
  digest.update(heldout.tobytes())
  key = f"bpe-{vocab_size}-{len(train)}-{len(heldout)}-{digest.hexdigest()[:16]}"
  path = os.path.join(cache_dir, key)
  files = [os.path.join(path, f) for f in ("tokenizer.json", "train.npy", "heldout.npy",
                                           "info.json")]
  if all(os.path.exists(f) for f in files):
    with open(files[3]) as f:
      info = json.load(f)
    tok = BPETokenizer.from_file(files[0])
    return tok, np.load(files[1]), np.load(files[2]), dict(info, path=path, trained=False)
  t0 = time.perf_counter()
  tok = train_bpe(train.tobytes(), vocab_size)
  t1 = time.perf_counter()
  dtype = _ids_dtype(tok.vocab_size)
  train_ids = tok.encode(train.tobytes()).astype(dtype)
  heldout_ids = tok.encode(heldout.tobytes()).astype(dtype)
  info = dict(target_vocab=vocab_size, vocab_size=tok.vocab_size, train_bytes=len(train),
              heldout_bytes=len(heldout), train_tokens=len(train_ids),
              heldout_tokens=len(heldout_ids), train_seconds=round(t1 - t0, 2),
              tokenize_seconds=round(time.perf_counter() - t1, 2))
  # Written to a scratch directory and renamed: an interrupted run leaves no partial cache.
  tmp = f"{path}.tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  tok.save(os.path.join(tmp, "tokenizer.json"))
  np.save(os.path.join(tmp, "train.npy"), train_ids)
  np.save(os.path.join(tmp, "heldout.npy"), heldout_ids)
  with open(os.path.join(tmp, "info.json"), "w") as f:
    json.dump(info, f, indent=1)
  shutil.rmtree(path, ignore_errors=True)
  os.replace(tmp, path)
  return tok, train_ids, heldout_ids, dict(info, path=path, trained=True)


def load(kind: str, path: str | None):
  """The tokenizer a run saved: its kind and, for "bpe", its tokenizer.json."""
  if kind == "bytes":
    return ByteTokenizer()
  if kind != "bpe":
    raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {kind!r}")
  return BPETokenizer.from_file(path)
