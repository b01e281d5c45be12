"""Real text with no download: the Python standard library's own .py files, as bytes.

Every document is one source file, tokenised at the byte level (vocabulary 256). Files are
split into train and held-out BY FILE (a hash of the file's path relative to the stdlib
root decides), so no held-out byte was ever seen in training. Each split is one stream of
tokens; a row of the batch is a window of T + 1 bytes of that stream, and
segment ids mark which document each position belongs to, so attention (and the loss)
never crosses a document boundary.

Batches are a pure function of (seed, step): resuming at step s draws exactly the batches
an uninterrupted run would have drawn, with no data-loader state to save.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
import zlib

import numpy as np

VOCAB_SIZE = 256  # bytes


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: pathlib.Path | None = None, min_bytes: int = 256) -> list[pathlib.Path]:
  """The stdlib's .py files, sorted, without third-party site-packages.

  Files shorter than min_bytes (mostly empty __init__.py) are skipped: they add segment
  boundaries but no text, and a floor on document length bounds the number of documents
  in a row (see max_segments_per_row).
  """
  root = stdlib_root() if root is None else root
  files = []
  for p in sorted(root.rglob("*.py")):
    rel = p.relative_to(root).parts
    if "site-packages" in rel or "dist-packages" in rel:
      continue
    try:
      if p.is_file() and p.stat().st_size >= min_bytes:
        files.append(p)
    except OSError:
      continue
  return files


def is_heldout(relative_path: str, heldout_percent: int) -> bool:
  """A stable, machine-independent split: crc32 of the path relative to the stdlib root."""
  return zlib.crc32(relative_path.encode()) % 100 < heldout_percent


def split_files(files: list[pathlib.Path], root: pathlib.Path, heldout_percent: int = 5
               ) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
  """(train files, held-out files); disjoint by construction."""
  train, heldout = [], []
  for p in files:
    (heldout if is_heldout(p.relative_to(root).as_posix(), heldout_percent) else train).append(p)
  return train, heldout


@dataclasses.dataclass(frozen=True)
class TokenStream:
  """All documents of one split, concatenated.

  tokens: uint8[L], the bytes. doc: int32[L], the index of the document each byte is from.
  """
  tokens: np.ndarray
  doc: np.ndarray
  files: tuple[str, ...]

  def __len__(self) -> int:
    return len(self.tokens)


def build_stream(files: list[pathlib.Path], root: pathlib.Path, max_bytes: int | None = None
                ) -> TokenStream:
  """Read files (in order) until max_bytes; a file is taken whole or not at all."""
  chunks, docs, names, total = [], [], [], 0
  for p in files:
    data = p.read_bytes()
    if max_bytes is not None and total + len(data) > max_bytes and chunks:
      break
    chunks.append(np.frombuffer(data, dtype=np.uint8))
    docs.append(np.full(len(data), len(names), dtype=np.int32))
    names.append(p.relative_to(root).as_posix())
    total += len(data)
  if not chunks:
    raise ValueError("no documents: the file list is empty")
  return TokenStream(np.concatenate(chunks), np.concatenate(docs), tuple(names))


def max_segments_per_row(seq_len: int, min_bytes: int) -> int:
  """Upper bound on documents in a window of seq_len bytes when each has >= min_bytes."""
  return -(-seq_len // min_bytes) + 1


@dataclasses.dataclass(frozen=True)
class Batch:
  """One batch of B rows of T positions.

  inputs: int32[B, T] bytes; targets: int32[B, T] the next byte;
  segment_ids: int32[B, T], 1, 2, ... numbering the documents within each row;
  loss_mask: float32[B, T], 0 where the next byte belongs to another document.
  """
  inputs: np.ndarray
  targets: np.ndarray
  segment_ids: np.ndarray
  loss_mask: np.ndarray


def batch_at(stream: TokenStream, starts: np.ndarray, seq_len: int) -> Batch:
  """Rows stream[s : s + T + 1] for each start s."""
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  tok = stream.tokens[idx].astype(np.int32)
  doc = stream.doc[idx]
  segment_ids = (doc[:, :-1] - doc[:, :1] + 1).astype(np.int32)
  loss_mask = (doc[:, 1:] == doc[:, :-1]).astype(np.float32)
  return Batch(tok[:, :-1], tok[:, 1:], segment_ids, loss_mask)


def train_batch(stream: TokenStream, step: int, batch_size: int, seq_len: int, seed: int) -> Batch:
  """The batch for a training step: random windows, a pure function of (seed, step)."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
  return batch_at(stream, starts, seq_len)


def heldout_batches(stream: TokenStream, num_batches: int, batch_size: int, seq_len: int
                   ) -> list[Batch]:
  """A fixed set of evenly spaced windows over the held-out stream."""
  rows = num_batches * batch_size
  last = len(stream) - seq_len - 1
  if last < 0:
    raise ValueError(f"held-out stream of {len(stream)} bytes is shorter than T+1={seq_len + 1}")
  starts = np.linspace(0, last, rows).astype(np.int64)
  return [batch_at(stream, starts[i * batch_size:(i + 1) * batch_size], seq_len)
          for i in range(num_batches)]


def load_splits(heldout_percent: int = 5, min_bytes: int = 256,
                max_train_bytes: int | None = None, max_heldout_bytes: int | None = None,
                root: pathlib.Path | None = None) -> tuple[TokenStream, TokenStream]:
  """(train stream, held-out stream) from the stdlib's source files."""
  root = stdlib_root() if root is None else root
  train_files, heldout_files = split_files(stdlib_files(root, min_bytes), root, heldout_percent)
  return (build_stream(train_files, root, max_train_bytes),
          build_stream(heldout_files, root, max_heldout_bytes))
