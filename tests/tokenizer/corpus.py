"""Deterministic (seeded) test strings for the tokenizer equality tests, and the training text.

Characters come from blocks assigned in old Unicode versions (≤ 6.0, emoji ≤ 8.0), so the
character properties PCRE2, utf8proc and the Rust crates behind HF tokenizers use agree; see
docs/tokenizer.md on Unicode versions.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Final

# (first, last) code point ranges by script.
SCRIPTS: Final = {
    "latin": [(0x41, 0x5A), (0x61, 0x7A), (0xC0, 0xFF), (0x100, 0x17F)],
    "greek": [(0x391, 0x3A9), (0x3B1, 0x3C9)],
    "cyrillic": [(0x410, 0x44F)],
    "hebrew": [(0x5D0, 0x5EA)],
    "arabic": [(0x621, 0x64A), (0x660, 0x669)],
    "devanagari": [(0x905, 0x939), (0x93E, 0x94D), (0x966, 0x96F)],
    "thai": [(0xE01, 0xE3A), (0xE40, 0xE4E)],
    "hangul": [(0xAC00, 0xD7A3)],
    "kana": [(0x3041, 0x3096), (0x30A1, 0x30FA)],
    "cjk": [(0x4E00, 0x9FA5)],
    "fullwidth": [(0xFF01, 0xFF5E)],
    "symbols": [(0x2190, 0x21FF), (0x2200, 0x22FF), (0x2500, 0x257F), (0x20A0, 0x20B5)],
    "combining": [(0x300, 0x36F)],
    "digits": [(0x30, 0x39), (0x660, 0x669), (0x966, 0x96F), (0xFF10, 0xFF19), (0x2160, 0x216F), (0xB2, 0xB3)],
    "punct": [(0x21, 0x2F), (0x3A, 0x40), (0x5B, 0x60), (0x7B, 0x7E), (0x2010, 0x2027), (0x3001, 0x3003)],
}
# Whitespace and other characters the regexes treat specially (U+0085 is \s for Oniguruma,
# U+180E is not, U+001C–U+001F are not, U+200B is not).
ODD_SPACES: Final = ["\u00a0", "\u0085", "\u180e", "\u2028", "\u2029", "\u3000", "\u200b", "\u2009", "\x0b", "\x0c",
                     "\x1c", "\x1f", "\ufeff", "\u202f", "\u1680"]
WHITESPACE: Final = [" ", " ", " ", "\t", "\n", "\r\n", "\r", "\n\n", "  ", "\t\t", " \n"]
EMOJI_BASE: Final = [(0x1F600, 0x1F64F), (0x1F300, 0x1F3F0), (0x1F680, 0x1F6C5), (0x2600, 0x26FF)]
SKIN_TONES: Final = [chr(c) for c in range(0x1F3FB, 0x1F400)]
ZWJ_SEQUENCES: Final = [
    "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466", "\U0001F469\u200d\u2764\ufe0f\u200d\U0001F468",
    "\U0001F3F3\ufe0f\u200d\U0001F308", "\U0001F441\ufe0f\u200d\U0001F5E8\ufe0f", "1\ufe0f\u20e3", "#\ufe0f\u20e3",
    "\U0001F1FA\U0001F1F8", "\U0001F1EF\U0001F1F5", "\u2764\ufe0f", "\U0001F44D\U0001F3FD",
]
CONTRACTIONS: Final = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'D",
                       "'ſ", "'K", "\u2019s", "'x", "''", "'"]
WORDS: Final = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part "
    "don't I'm we've they'll she'd it's can't won't Hello World HTTP JSON API url_path snake_case camelCase "
    "naïve café résumé Zürich straße Ελλάδα Москва 東京 서울 नमस्ते مرحبا שלום"
).split()
NUMBERS: Final = ["0", "7", "42", "123", "1234", "12345", "3.14159", "1,000,000", "2024-05-17", "09:30", "1e-9",
                  "0x1F", "١٢٣", "१२३४", "１２３", "Ⅻ", "²"]
NFC_CASES: Final = ["e\u0301", "A\u030a", "\u1100\u1161", "\u1100\u1161\u11a8", "o\u0308\u0304", "\u0041\u0327\u0301",
                    "\u212b", "\u2126", "\u0344", "n\u0303", "\u0915\u093c", "\u05d1\u05bc"]
ODD: Final = ["\x00", "\x01", "\x7f", "\ufffd", "\ue000", "\U0010fffd", "\U00020000", "\U0002a6d6", "<0xFF>", "\\xff",
              "Ġ", "Ċ", "ĠĠ", "âĢ", "Ã©", "<|", "|>", "<||>", "<|im", "_end|>", "<think", "</think", "<", ">",
              "\u00ad", "\u034f", "\u200d", "\u2060", "\ufe0f"]


def _char(rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    lo, hi = rng.choice(ranges)
    return chr(rng.randint(lo, hi))


def _script_run(rng: random.Random) -> str:
    script = rng.choice(list(SCRIPTS))
    text = "".join(_char(rng, SCRIPTS[script]) for _ in range(rng.randint(1, 12)))
    if script != "combining" and rng.random() < 0.3:  # marks on letters
        text += "".join(_char(rng, SCRIPTS["combining"]) for _ in range(rng.randint(1, 3)))
    return text


def _emoji(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.4:
        return rng.choice(ZWJ_SEQUENCES)
    base = _char(rng, EMOJI_BASE)
    if roll < 0.7:
        base += rng.choice(SKIN_TONES)
    if rng.random() < 0.2:
        base += "\ufe0f"
    return base


def _whitespace(rng: random.Random) -> str:
    return "".join(rng.choice(WHITESPACE + ODD_SPACES[:4]) for _ in range(rng.randint(1, 8)))


def _digits(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(NUMBERS)
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 25)))


def _contraction(rng: random.Random) -> str:
    word = rng.choice(WORDS)
    if rng.random() < 0.5:
        word = "".join(c.upper() if rng.random() < 0.5 else c for c in word)
    return word + rng.choice(CONTRACTIONS)


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def _odd(rng: random.Random) -> str:
    return rng.choice(ODD + NFC_CASES + ODD_SPACES)


Piece = Callable[[random.Random], str]
PIECES: Final[list[tuple[Piece, float]]] = [
    (_word, 6.0), (_whitespace, 3.0), (_script_run, 3.0), (_emoji, 1.5), (_digits, 1.5), (_contraction, 1.5),
    (_odd, 1.0),
]


def random_string(rng: random.Random, specials: list[str], max_pieces: int = 24) -> str:
    """One test string: a random mix of the pieces above, sometimes with special tokens in it."""
    funcs, weights = zip(*PIECES)
    parts: list[str] = []
    for _ in range(rng.randint(0, max_pieces)):
        if specials and rng.random() < 0.06:
            parts.append(rng.choice(specials))
            continue
        parts.append(rng.choices(funcs, weights)[0](rng))
        if rng.random() < 0.5:
            parts.append(" ")
    return "".join(parts)


def make_strings(seed: int, count: int, specials: list[str]) -> list[str]:
    """`count` strings from `seed`: hand-picked edge cases first, then random ones."""
    rng = random.Random(seed)
    fixed = ["", " ", "  ", "\n", "\r\n", "\t", " \t\n", "a", "Hello world", "Hello  world", "hello\n\nworld",
             "   leading", "trailing   ", "x\r\n\r\ny", "I'M DON'T we'Ve", "1234567890", "１２３４５"]
    fixed += ODD + NFC_CASES + ODD_SPACES + ZWJ_SEQUENCES + NUMBERS
    fixed += [f"{a}{s}{b}" for s in specials[:8] for a, b in [("", ""), (" ", " "), ("x", "y"), ("\n", "\n")]]
    fixed += ["".join(specials[:3]), specials[0] * 3 if specials else "", "<" + (specials[0] if specials else "")]
    out = fixed[:count]
    while len(out) < count:
        out.append(random_string(rng, specials))
    return out


def training_corpus() -> Iterator[str]:
    """The text the families' BPE vocabularies are trained on (seeded, a few hundred KB)."""
    rng = random.Random(20)
    for _ in range(6000):
        yield random_string(rng, [], max_pieces=40)
