"""Offline text: the Python standard library's own sources, as bytes.

The corpus is the first `max_bytes` of the stdlib's .py files in a fixed order: the same on
every machine with the same Python, no download (or those of another source tree). The last
`heldout_fraction` of it is held out. tokenizer.py turns both splits into token ids.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np


def load_corpus(max_bytes: int, root: str | None = None) -> np.ndarray:
  """The first `max_bytes` of the .py files under `root` (default: the standard library) in a
  fixed order (a directory's files by name, then its subdirectories by name); test, tests,
  site-packages, __pycache__ and idlelib directories skipped."""
  root = root or sysconfig.get_paths()["stdlib"]
  chunks, total = [], 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests",
                                                           "__pycache__", "idlelib"))
    for name in sorted(filenames):
      if not name.endswith(".py"):
        continue
      with open(os.path.join(dirpath, name), "rb") as f:
        data = f.read()
      chunks.append(data)
      total += len(data)
      if total >= max_bytes:
        return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)
  return np.frombuffer(b"".join(chunks), np.uint8)


def split(corpus: np.ndarray, heldout_fraction: float):
  cut = int(len(corpus) * (1 - heldout_fraction))
  return corpus[:cut], corpus[cut:]


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy of the token frequencies, in nats per token: what a model that ignores context
  achieves (any vocabulary: ids that never occur add nothing)."""
  p = np.bincount(tokens).astype(np.float64)
  p = p[p > 0] / p.sum()
  return float(-(p * np.log(p)).sum())


def batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int):
  """(inputs, targets) int32 (batch, seq_len): random windows, deterministic in (seed, step)."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)  # windows of seq_len + 1
  idx = starts[:, None] + np.arange(seq_len + 1)[None]
  window = tokens[idx].astype(np.int32)
  return window[:, :-1], window[:, 1:]


def heldout_batches(tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int):
  """Fixed evaluation windows spread over the held-out split."""
  span = len(tokens) - seq_len - 1
  starts = np.linspace(0, span, num_batches * batch_size).astype(np.int64)
  for b in range(num_batches):
    s = starts[b * batch_size:(b + 1) * batch_size]
    idx = s[:, None] + np.arange(seq_len + 1)[None]
    window = tokens[idx].astype(np.int32)
    yield window[:, :-1], window[:, 1:]

