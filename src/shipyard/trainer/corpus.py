"""The mid-training code corpus: Python sources found on this machine, de-duplicated, split by
file into train and held-out, tokenized and packed.

Contract:
- :func:`source_files` lists ``*.py`` files under ``midtrain.corpus_dirs`` (default: this
  interpreter's standard library and site-packages), skipping files over ``max_file_bytes`` and
  files that are not UTF-8.
- :func:`build_corpus` de-duplicates them by content (SHA-256), keeps the ``max_files`` with the
  smallest hashes (a choice independent of the file system's order), puts a file in held-out iff
  the last 64 bits of its hash, read as a fraction of 2^64, are below ``heldout_frac`` (so a file and every copy of it is
  on one side only), tokenizes each file, appends the end-of-text token and concatenates the files
  of each split in hash order. It writes ``train.npy`` and ``heldout.npy`` (int32 token ids) and
  then ``corpus.json`` (counts, settings, the held-out files' hashes) last, each atomically; a
  corpus whose ``corpus.json`` matches the settings is reused, anything else is rebuilt.
- :class:`Corpus` serves fixed-length windows: training sequence ``i`` is tokens
  ``[i * L, (i + 1) * L)`` of the train split (the tail shorter than ``L`` is dropped).
Limits: Python only; the corpus is held in memory (4 bytes a token); tokenizing runs on one core
(about 1-2 M tokens/min with the SmolLM2 tokenizer here).

Shape legend: N = tokens of a split, S = sequences, L = ``seq_len``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shipyard.config.schema import MidtrainConfig

FORMAT = 2


def default_dirs() -> list[Path]:
    """This interpreter's standard library and site-packages (each once)."""
    paths = sysconfig.get_paths()
    out: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key]).resolve()
        if p.is_dir() and p not in out:
            out.append(p)
    return out


def source_files(cfg: MidtrainConfig) -> list[Path]:
    """Every ``*.py`` file (not over ``max_file_bytes``) under the configured directories, sorted."""
    dirs = [Path(d).expanduser() for d in cfg.corpus_dirs] or default_dirs()
    for d in dirs:
        if not d.is_dir():
            raise ValueError(f"midtrain.corpus_dirs: {d} is not a directory")
    found: set[Path] = set()
    for d in dirs:
        for root, _subdirs, names in os.walk(d):
            for name in names:
                if name.endswith(".py"):
                    path = Path(root) / name
                    try:
                        if 0 < path.stat().st_size <= cfg.max_file_bytes:
                            found.add(path)
                    except OSError:
                        continue  # a dangling link or a file removed while walking
    return sorted(found)


def _distinct(files: list[Path], max_files: int) -> list[tuple[str, str]]:
    """(sha256 hex, text) of the distinct UTF-8 files, the ``max_files`` smallest hashes, hash order."""
    by_hash: dict[str, str] = {}
    for path in files:
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            by_hash.setdefault(hashlib.sha256(data).hexdigest(), text)
    return sorted(by_hash.items())[:max_files]


def is_heldout(sha: str, frac: float) -> bool:
    """Whether the file of content hash ``sha`` is held out: its LAST 16 hex digits / 2^64 < frac
    (independent of the leading digits that choose the ``max_files`` kept)."""
    return int(sha[-16:], 16) / 2.0**64 < frac


@dataclass
class Corpus:
    """The packed splits and their record (``info``: counts, settings, held-out hashes)."""

    train_N: np.ndarray
    heldout_N: np.ndarray
    info: dict[str, Any]
    seq_len: int

    def num_train_seqs(self) -> int:
        return len(self.train_N) // self.seq_len

    def train_seq(self, i: int) -> np.ndarray:
        return self.train_N[i * self.seq_len : (i + 1) * self.seq_len]

    def heldout_seqs(self, n: int) -> np.ndarray:
        """``[S, L]``: the first ``n`` held-out windows (fewer if the split is shorter)."""
        count = min(n, len(self.heldout_N) // self.seq_len)
        return self.heldout_N[: count * self.seq_len].reshape(count, self.seq_len)


def _settings(cfg: MidtrainConfig, tok: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "corpus_dirs": [str(d) for d in ([Path(x).expanduser() for x in cfg.corpus_dirs] or default_dirs())],
        "max_files": cfg.max_files,
        "max_file_bytes": cfg.max_file_bytes,
        "heldout_frac": cfg.heldout_frac,
        "tokenizer": getattr(tok, "name_or_path", ""),
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
    }


def build_corpus(cfg: MidtrainConfig, tok: Any, out_dir: Path, log: Any = print) -> Corpus:
    """The corpus for ``cfg`` in ``out_dir`` (module doc): reused when its record matches, else built."""
    out_dir = Path(out_dir)
    settings = _settings(cfg, tok)
    manifest = out_dir / "corpus.json"
    if manifest.is_file():
        info = json.loads(manifest.read_text())
        if info.get("settings") == settings:
            return _load(out_dir, info, cfg.seq_len)
    files = source_files(cfg)
    distinct = _distinct(files, cfg.max_files)
    if not distinct:
        where = cfg.corpus_dirs or [str(d) for d in default_dirs()]
        raise ValueError(f"midtrain.corpus_dirs: no Python (*.py, UTF-8) files under {where}")
    log(f"corpus: {len(files)} files, {len(distinct)} distinct kept; tokenizing")
    splits: dict[str, list[int]] = {"train": [], "heldout": []}
    heldout_hashes = []
    for sha, text in distinct:
        side = "heldout" if is_heldout(sha, cfg.heldout_frac) else "train"
        if side == "heldout":
            heldout_hashes.append(sha)
        splits[side].extend(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    if len(splits["heldout"]) < cfg.seq_len or len(splits["train"]) < cfg.seq_len:
        raise ValueError(
            f"midtrain: the corpus under {settings['corpus_dirs']} is too small for midtrain.seq_len="
            f"{cfg.seq_len} ({len(splits['train'])} train / {len(splits['heldout'])} held-out tokens): "
            "add files (midtrain.corpus_dirs, midtrain.max_files) or raise midtrain.heldout_frac"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for side, ids in splits.items():
        _save_atomic(out_dir / f"{side}.npy", np.asarray(ids, dtype=np.int32))
    info = {
        "settings": settings,
        "files_found": len(files),
        "files_distinct": len(distinct),
        "files_heldout": len(heldout_hashes),
        "train_tokens": len(splits["train"]),
        "heldout_tokens": len(splits["heldout"]),
        "heldout_hashes": heldout_hashes,
    }
    tmp = manifest.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, manifest)  # written last: the corpus exists once this does
    return _load(out_dir, info, cfg.seq_len)


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(out_dir: Path, info: dict[str, Any], seq_len: int) -> Corpus:
    return Corpus(np.load(out_dir / "train.npy"), np.load(out_dir / "heldout.npy"), info, seq_len)
