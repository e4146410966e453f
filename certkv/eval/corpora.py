"""Real long-form book text, offline: Debian's R data packages, parsed and cached as plain text.

Jane Austen's six novels ship in Debian's ``r-cran-janeaustenr`` and Moby Dick (Gutenberg #2701)
in ``r-cran-tokenizers``, each as an R character vector of lines inside the package's lazy-load
database ``data/Rdata.rdb`` (index: ``data/Rdata.rdx``). :func:`book_text` fetches a package once
(``apt-get download`` + ``dpkg-deb -x``), decodes it with the small R-serialization reader below
and caches every book of that package as ``<cache>/books/<name>.txt``; later calls only read that
file, so apt is needed once per cache directory.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import lzma
import os
import struct
import subprocess
import tempfile
import weakref
import zlib
from collections import OrderedDict
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from certkv.errors import CertKVError
from certkv.files import data_dir, write_atomic

# book name -> (Debian package, R package folder, R object name in data/Rdata.rdb)
BOOKS: dict[str, tuple[str, str, str]] = {
    "emma": ("r-cran-janeaustenr", "janeaustenr", "emma"),
    "mansfield_park": ("r-cran-janeaustenr", "janeaustenr", "mansfieldpark"),
    "northanger_abbey": ("r-cran-janeaustenr", "janeaustenr", "northangerabbey"),
    "persuasion": ("r-cran-janeaustenr", "janeaustenr", "persuasion"),
    "pride_and_prejudice": ("r-cran-janeaustenr", "janeaustenr", "prideprejudice"),
    "sense_and_sensibility": ("r-cran-janeaustenr", "janeaustenr", "sensesensibility"),
    "moby_dick": ("r-cran-tokenizers", "tokenizers", "mobydick"),
}

# --------------------------------------------------------------------------------------------
# R serialization ("X\n" = XDR, big-endian; versions 2 and 3), the subset data packages use.
# Item header int: bits 0-7 SEXP type, bit 9 has-attributes, bit 10 has-tag, bits 12-27 "levels"
# (for CHARSXP the encoding: LATIN1 = 4). Lengths are int32, or -1 then two int32 for long ones.
# --------------------------------------------------------------------------------------------
SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 1, 2, 9, 10, 13, 14, 16, 19
EXPRSXP, NILVALUE_SXP, REFSXP = 20, 254, 255
HAS_ATTR, HAS_TAG, LATIN1 = 1 << 9, 1 << 10, 4
NA_INTEGER = -(2**31)
_REREAD = "delete the cached .deb under the cache folder so book_text downloads it again"


class RVector(list):
    """An R vector as a Python list (NA -> None) with its R attributes (``names``, ``class``...)."""

    def __init__(self, values: list, sexptype: int, attributes: dict | None = None):
        super().__init__(values)
        self.sexptype = sexptype
        self.attributes = attributes or {}

    def named(self) -> dict[str, Any]:
        """The elements keyed by the ``names`` attribute (R's ``x[["name"]]``)."""
        return dict(zip(self.attributes.get("names", []), self, strict=True))


class _RReader:
    """Cursor over one serialized R object; symbols go to the reference table as R does."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CertKVError(f"R serialized data ends early at byte {self.pos}; {_REREAD}.")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def ints(self, n: int) -> tuple[int, ...]:
        return struct.unpack(f">{n}i", self.take(4 * n))

    def length(self) -> int:
        n = self.ints(1)[0]
        if n == -1:
            high, low = self.ints(2)
            n = (high << 32) + low
        return n

    def header(self) -> None:
        """``X\\n``, format version, writer and minimal reader R versions, v3: native encoding."""
        if self.take(2) != b"X\n":
            raise CertKVError(f"data is not R XDR serialization (no 'X\\n' header); {_REREAD}.")
        version = self.ints(3)[0]
        if version not in (2, 3):
            raise CertKVError(f"R serialization version {version} is unsupported; {_REREAD}.")
        if version == 3:
            self.take(self.length())

    def item(self) -> Any:
        """One R object: None (NULL), str (symbol or CHARSXP), dict (pairlist) or RVector."""
        flags = self.ints(1)[0]
        sexptype = flags & 0xFF
        if sexptype == NILVALUE_SXP:
            return None
        if sexptype == REFSXP:
            return self.refs[(flags >> 8 or self.ints(1)[0]) - 1]
        if sexptype == SYMSXP:
            self.refs.append(self.item())
            return self.refs[-1]
        if sexptype == LISTSXP:
            return self.pairlist(flags)
        if sexptype == CHARSXP:
            return self.charsxp(flags)
        values = self.vector(sexptype)
        attributes = self.item() if flags & HAS_ATTR else {}
        return RVector(values, sexptype, attributes)

    def pairlist(self, flags: int) -> dict:
        """Pairlist cells up to R's NULL as ``{tag: value}`` (untagged cells keyed 0, 1, ...)."""
        cells: dict = {}
        while flags & 0xFF == LISTSXP:
            if flags & HAS_ATTR:
                self.item()
            tag = self.item() if flags & HAS_TAG else len(cells)
            cells[tag] = self.item()
            flags = self.ints(1)[0]
        if flags & 0xFF != NILVALUE_SXP:
            raise CertKVError(f"R pairlist ends in type {flags & 0xFF}, not NULL; {_REREAD}.")
        return cells

    def charsxp(self, flags: int) -> str | None:
        n = self.ints(1)[0]
        if n == -1:
            return None
        encoding = "latin-1" if (flags >> 12) & LATIN1 else "utf-8"
        return self.take(n).decode(encoding, errors="replace")

    def vector(self, sexptype: int) -> list:
        if sexptype not in (LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, EXPRSXP):
            raise CertKVError(
                f"R object type {sexptype} is outside this reader's subset (NULL, symbols, "
                f"pairlists, logical/integer/double/character vectors, lists); export the text "
                f"with R's writeLines() and place it at the book's cache path instead."
            )
        n = self.length()
        if sexptype in (LGLSXP, INTSXP):
            return [None if v == NA_INTEGER else v for v in self.ints(n)]
        if sexptype == REALSXP:
            return list(struct.unpack(f">{n}d", self.take(8 * n)))
        return [self.item() for _ in range(n)]


def unserialize(data: bytes) -> Any:
    """Decode one R object from XDR serialization bytes (gzip-wrapped ``.rds`` accepted too)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    reader = _RReader(data)
    reader.header()
    return reader.item()


def _inflate(record: bytes, compressed: int) -> bytes:
    """One ``.rdb`` record: 4-byte big-endian inflated size, then zlib data (``compressed`` 1)
    or a type byte (``0`` stored, ``2`` bzip2, ``Z`` xz) and the data (``compressed`` 2 or 3)."""
    size = struct.unpack(">I", record[:4])[0]
    if compressed in (2, 3):
        codecs = {b"0": bytes, b"2": bz2.decompress, b"Z": lzma.decompress}
        if record[4:5] not in codecs:
            raise CertKVError(f"R lazy-load record has unknown type byte {record[4:5]!r}; "
                              f"{_REREAD}.")
        data = codecs[record[4:5]](record[5:])
    else:
        data = zlib.decompress(record[4:])
    if len(data) != size:
        raise CertKVError(f"R lazy-load record inflates to {len(data)} bytes, not {size}; "
                          f"{_REREAD}.")
    return data


def read_lazyload(stem: str | Path) -> dict[str, Any]:
    """Every object of an R lazy-load database ``<stem>.rdb`` + ``<stem>.rdx``, keyed by name.

    The ``.rdx`` index is a serialized list ``(variables, references, compressed)`` whose
    ``variables`` maps each name to ``(offset, length)`` in bytes inside the ``.rdb``.
    """
    stem = Path(stem)
    index = unserialize(stem.with_suffix(".rdx").read_bytes()).named()
    compressed = int(index["compressed"][0])
    rdb = stem.with_suffix(".rdb").read_bytes()
    return {
        name: unserialize(_inflate(rdb[offset : offset + length], compressed))
        for name, (offset, length) in index["variables"].named().items()
    }


def _book_from_r(value: Any, name: str) -> str:
    """A character vector of lines (NA -> empty line) joined with ``\\n``, as clean text.

    janeaustenr stores one element per line; tokenizers stores Moby Dick as one Gutenberg file
    (BOM, CRLF, license header/footer), reduced here to the text between the ``*** START OF``
    and ``*** END OF`` marker lines.
    """
    if not (isinstance(value, RVector) and value.sexptype == STRSXP):
        raise CertKVError(f"R object for {name!r} is not a character vector; {_REREAD}.")
    text = "\n".join(line or "" for line in value).lstrip("\ufeff").replace("\r\n", "\n")
    start, end = text.find("*** START OF"), text.find("*** END OF")
    if 0 <= start < end:
        text = text[text.index("\n", start) + 1 : end].strip("\n")
    return text


# --------------------------------------------------------------------------------------------
# Fetching and caching.
# --------------------------------------------------------------------------------------------


def available_books() -> list[str]:
    """Names accepted by :func:`book_text`, sorted."""
    return sorted(BOOKS)


def default_cache_dir() -> Path:
    """``$CERTKV_DATA`` if set, else ``~/.cache/certkv``."""
    return data_dir()


def _run(command: list[str], cwd: Path, manual: str) -> None:
    """Run a command; a missing program or a non-zero exit becomes one CertKVError sentence
    ending in ``manual`` (how to place the text by hand)."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise CertKVError(f"{command[0]} is not installed, so the book cannot be fetched from "
                          f"Debian; {manual}.") from None
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or ["no error output"])[-1]
        raise CertKVError(f"`{' '.join(command)}` failed ({detail}); run `apt-get update` and "
                          f"retry, or {manual}.")


def _download_deb(package: str, cache: Path, manual: str) -> Path:
    """The package's ``.deb`` under ``<cache>/debs``, downloaded with apt-get if absent."""
    debs = cache / "debs"
    found = sorted(debs.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    debs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        try:
            _run(["apt-get", "download", package], Path(tmp), manual)
        except CertKVError:
            if not hasattr(os, "geteuid") or os.geteuid() != 0:
                raise
            _run(["apt-get", "update", "-qq"], Path(tmp), manual)  # stale package lists
            _run(["apt-get", "download", package], Path(tmp), manual)
        for deb in Path(tmp).glob(f"{package}_*.deb"):
            os.replace(deb, debs / deb.name)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        raise CertKVError(f"apt-get download left no {package} .deb in {debs}; {manual}.")
    return found[-1]


def _cache_package_books(package: str, cache: Path, manual: str) -> None:
    """Extract every book of a Debian package into ``<cache>/books/<name>.txt``."""
    deb = _download_deb(package, cache, manual)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".extract-") as tmp:
        _run(["dpkg-deb", "-x", str(deb), tmp], cache, manual)
        for name, (pkg, r_folder, r_name) in BOOKS.items():
            if pkg != package:
                continue
            stem = Path(tmp) / "usr/lib/R/site-library" / r_folder / "data" / "Rdata"
            if not stem.with_suffix(".rdx").exists():
                raise CertKVError(f"{deb.name} holds no data/Rdata.rdx; {manual}.")
            objects = read_lazyload(stem)
            if r_name not in objects:
                raise CertKVError(f"{deb.name} holds no R object {r_name!r}; {manual}.")
            write_atomic(cache / "books" / f"{name}.txt", _book_from_r(objects[r_name], name))


def book_text(name: str = "emma", cache_dir: str | Path | None = None) -> str:
    """Full plain text of a public-domain book (lines joined with ``\\n``), cached on disk.

    The first call for a package runs ``apt-get download`` and ``dpkg-deb -x`` (Debian, no
    root needed) and caches all of its books; later calls read ``<cache>/books/<name>.txt``.
    ``cache_dir`` defaults to ``$CERTKV_DATA`` or ``~/.cache/certkv``.
    """
    if name not in BOOKS:
        raise CertKVError(f"unknown book {name!r}; use one of {', '.join(available_books())}.")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / "books" / f"{name}.txt"
    if not path.exists():
        package = BOOKS[name][0]
        manual = f"save the book as UTF-8 plain text at {path}"
        cache.mkdir(parents=True, exist_ok=True)
        _cache_package_books(package, cache, manual)
    return path.read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Tokens.
# --------------------------------------------------------------------------------------------


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (HF tokenizers) or plain ``encode(text)``."""
    return _remembered(tokenizer, (text,), lambda: [_encode(tokenizer, text)])[0]


def encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """:func:`encode` of each of ``texts``, as one batch where the tokenizer takes one (HF
    tokenizers: a book's sentences in one call instead of thousands)."""
    return _remembered(tokenizer, tuple(texts), lambda: _encode_many(tokenizer, texts))


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))


def _encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    try:
        batch = tokenizer(texts, add_special_tokens=False)["input_ids"]
    except (TypeError, KeyError, AttributeError):
        return [_encode(tokenizer, text) for text in texts]
    return [list(ids) for ids in batch]


REMEMBER_CHARS = 20_000  # texts at least this long are tokenized once per process and tokenizer
REMEMBERED = 8  # the most recent such encodings kept (a book's ids: about 2 MB)
_ENCODED: OrderedDict = OrderedDict()  # (tokenizer fingerprint, texts) -> ids
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _remembered(tokenizer: Any, texts: tuple[str, ...], encode_now) -> list[list[int]]:
    """``encode_now()``, or the ids of the same long ``texts`` under an identical tokenizer
    encoded earlier in this process (copies: callers may change them). A book is tokenized
    whole for perplexity windows and sentence by sentence for needle fillers, each about 0.2 s;
    a sweep or a test session runs that again for every job otherwise. Identical means the same
    serialized tokenizer (its normalizer, pre-tokenizer, model and added tokens), whatever
    object or path it came from; tokenizers without one are never remembered."""
    key = None
    if sum(map(len, texts)) >= REMEMBER_CHARS:
        fingerprint = _fingerprint(tokenizer)
        key = None if fingerprint is None else (fingerprint, texts)
    if key is None:
        return encode_now()
    if key not in _ENCODED:
        encoded = encode_now()
        _ENCODED[key] = (np.fromiter((i for ids in encoded for i in ids), np.int64),
                         np.cumsum([0, *map(len, encoded)]))  # 8 bytes a token, not ~36
        while len(_ENCODED) > REMEMBERED:
            _ENCODED.popitem(last=False)
        return encoded
    _ENCODED.move_to_end(key)
    flat, ends = _ENCODED[key]
    return [flat[a:b].tolist() for a, b in pairwise(ends)]


def _fingerprint(tokenizer: Any) -> str | None:
    """A digest of an HF fast tokenizer's serialization (once per tokenizer object), or None."""
    try:
        if tokenizer in _FINGERPRINTS:
            return _FINGERPRINTS[tokenizer]
    except TypeError:  # not weakly referenceable, or unhashable
        return None
    to_str = getattr(getattr(tokenizer, "backend_tokenizer", None), "to_str", None)
    if to_str is None:
        return None
    digest = hashlib.sha256(to_str().encode()).hexdigest()
    _FINGERPRINTS[tokenizer] = digest
    return digest


def token_windows(
    tokenizer: Any, text: str, length: int, count: int, start: int = 0
) -> list[list[int]]:
    """``count`` consecutive, non-overlapping windows of ``length`` token ids each.

    Window ``i`` is ``ids[start + i * length : start + (i + 1) * length]`` of the tokenized
    ``text``; the result is ``count`` lists of ``length`` ints.
    """
    if length < 1 or count < 1 or start < 0:
        raise CertKVError(f"token_windows needs length >= 1, count >= 1 and start >= 0, got "
                          f"length={length}, count={count}, start={start}; pass valid values.")
    ids = encode(tokenizer, text)
    needed = start + length * count
    if needed > len(ids):
        raise CertKVError(f"the text has {len(ids)} tokens but {count} windows of {length} from "
                          f"token {start} need {needed}; use a longer book or fewer/shorter "
                          f"windows.")
    return [ids[start + i * length : start + (i + 1) * length] for i in range(count)]


# --------------------------------------------------------------------------------------------
# Corpora of documents (the perplexity task's PG-19 protocol).
# --------------------------------------------------------------------------------------------

PG19 = "pg19"  # the hub's emozilla/pg19 test split (needs network and the datasets package)


def corpus_documents(corpus: str, limit: int | None = None) -> list[tuple[str, str]]:
    """``(name, text)`` documents of a corpus: a book name (:func:`available_books`), ``books``
    (every offline book), a directory of ``.txt`` files, or ``pg19`` (PG-19's test split from
    the hub, streamed; at most ``limit`` documents)."""
    if corpus in BOOKS:
        return [(corpus, book_text(corpus))]
    if corpus == "books":
        return [(name, book_text(name)) for name in available_books()]
    if corpus == PG19:
        return _pg19_documents(limit)
    folder = Path(corpus).expanduser()
    if folder.is_dir():
        files = sorted(folder.glob("*.txt"))
        if not files:
            raise CertKVError(f"{folder} holds no .txt files; put UTF-8 text files there or "
                              f"use corpus=books.")
        return [(f.stem, f.read_text(encoding="utf-8")) for f in files]
    raise CertKVError(f"corpus {corpus!r} is neither a book ({', '.join(available_books())}), "
                      f"'books', 'pg19' nor a directory of .txt files; pick one of those.")


def _pg19_documents(limit: int | None) -> list[tuple[str, str]]:
    """The first ``limit`` books of PG-19's test split (``emozilla/pg19``), streamed."""
    try:
        import datasets
    except ImportError as exc:
        raise CertKVError("corpus=pg19 needs the datasets package; pip install datasets, or "
                          "use corpus=books (offline).") from exc
    try:
        stream = datasets.load_dataset("emozilla/pg19", split="test", streaming=True)
        docs = []
        for row in stream:
            docs.append((str(row.get("short_book_title") or len(docs)), row["text"]))
            if limit is not None and len(docs) >= limit:
                break
        return docs
    except Exception as exc:  # offline, hub errors: one sentence, the offline alternative
        raise CertKVError(f"PG-19 could not be read from the hub ({type(exc).__name__}); check "
                          f"the network or use corpus=books (offline).") from exc


def corpus_windows(tokenizer: Any, corpus: str, length: int,
                   count: int) -> list[tuple[str, list[int]]]:
    """``count`` non-overlapping windows of ``length`` tokens as ``(document, ids)``: the first
    window of every document long enough, then the second of each, and so on (the paper's PG-19
    chunks, spread over books)."""
    docs = corpus_documents(corpus, limit=count)
    ids = [(name, encode(tokenizer, text)) for name, text in docs]
    ids = [(name, toks) for name, toks in ids if len(toks) >= length]
    if not ids:
        raise CertKVError(f"no document of corpus {corpus!r} has {length} tokens; use a longer "
                          f"corpus or a shorter context.")
    windows, round_ = [], 0
    while len(windows) < count:
        added = False
        for name, toks in ids:
            start = round_ * length
            if start + length <= len(toks) and len(windows) < count:
                windows.append((name, toks[start:start + length]))
                added = True
        if not added:
            raise CertKVError(f"corpus {corpus!r} holds only {len(windows)} windows of {length} "
                              f"tokens, fewer than {count}; ask for fewer windows.")
        round_ += 1
    return windows
