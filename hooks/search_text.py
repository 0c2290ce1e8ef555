"""Give the search index readable text: math as plain symbols, no notebook chrome.

Material's search plugin indexes each page's HTML as it stands when ``on_page_context`` runs. That HTML
holds math as TeX for MathJax to typeset in the browser (``\\(T \\times T\\)`` from arithmatex, ``$T_q$``
in notebook markdown), and notebook cells carry prompts (``In [4]:``), a copy button's ``Copied!``
notice and ``¶`` anchors. A search preview would show all of it raw.

This hook swaps in a search-only copy of the HTML just before the search plugin reads it, and puts the
page's own HTML back just after (two ``on_page_context`` handlers, at priorities either side of the
plugin's default 0, through MkDocs' ``CombinedEvent``), so the page a reader sees is untouched:

* arithmatex spans and blocks, and ``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]`` inside notebook
  markdown, become plain text: ``\\frac{a}{b}`` reads ``a/b``, ``\\ell`` reads ``ℓ``,
  ``e^{S - m}`` reads ``e^(S - m)`` (``tex_to_text``);
* notebook prompts, the copy button (its ``Copied!`` notice and the hidden second copy of the cell's code)
  and heading anchors are dropped (``strip_notebook_chrome``).

``tests/site/test_build.py`` fails if TeX or chrome reaches ``search/search_index.json`` again.
"""

from __future__ import annotations

import re
import unicodedata
from html import escape, unescape

from mkdocs.plugins import CombinedEvent, event_priority

# --- TeX to text -----------------------------------------------------------------------------------

SYMBOLS = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "mu": "μ", "tau": "τ",
    "sigma": "σ", "Theta": "Θ", "Omega": "Ω", "ell": "ℓ", "infty": "∞", "partial": "∂",
    "cdot": "·", "times": "×", "div": "÷", "pm": "±", "circ": "∘", "oplus": "⊕", "cup": "∪", "wedge": "∧",
    "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥", "ne": "≠", "neq": "≠", "approx": "≈", "ll": "≪", "gg": "≫",
    "in": "∈", "to": "→", "rightarrow": "→", "leftarrow": "←", "longrightarrow": "⟶", "iff": "⟺",
    "Longleftrightarrow": "⟺", "top": "⊤", "sum": "Σ", "sqrt": "√", "varnothing": "∅", "dots": "…",
    "ldots": "…", "cdots": "⋯", "lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈", "rceil": "⌉",
    "lvert": "|", "rvert": "|", "vert": "|", "{": "{", "}": "}", "|": "‖", "_": "_", "%": "%", "$": "$",
    "log": "log", "ln": "ln", "exp": "exp", "max": "max", "min": "min", "lim": "lim", "bmod": "mod",
    ",": " ", ";": " ", ":": " ", "!": "", " ": " ", "quad": " ", "qquad": " ", "\\": "; ",
}  # fmt: skip
# Macros that only style or size what follows: the text is what follows.
IGNORED = {"left", "right", "big", "Big", "bigg", "Bigg", "textstyle", "displaystyle", "scriptstyle", "nonumber"}
# Macros whose one argument is the text (\mathbb{R} reads R: the letter is what a reader searches for).
TEXT_ARGUMENT = {"text", "mathrm", "operatorname", "mathbf", "mathit", "mathbb", "mathcal", "mathsf", "mathtt",
                 "textrm", "textbf", "textit", "mathrel", "mathop", "boldsymbol", "hat", "bar", "vec"}  # fmt: skip
DROPPED_ARGUMENT = {"begin", "end", "phantom", "hphantom", "vphantom", "label", "tag"}
FRACTIONS = {"frac", "tfrac", "dfrac"}
# Accents with a combining character: \tilde{O} reads Õ.
COMBINING = {"tilde": "\u0303", "dot": "\u0307", "ddot": "\u0308"}

_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|\s+|.", re.S)
_SIMPLE = re.compile(r"[\w.′∞⊤√]+")  # needs no parentheses after ^ or / (2^31, a/b, K^⊤)
# Operators and relations read with a space either side: T\times d reads "T × d".
_SPACED = set("×·÷±∘⊕∪∧≤≥≠≈≪≫∈→←⟶⟺")


def tex_to_text(tex: str) -> str:
    """Plain text for a TeX formula, as a reader would say it: ``\\frac{QK^\\top}{\\sqrt d}`` -> ``(QK^⊤)/√d``."""
    tokens = _TOKEN.findall(tex)
    text, _ = _convert(tokens, 0, stop=None)
    text = re.sub(r"\s+", " ", text).replace(" ;", ";").strip()
    return unicodedata.normalize("NFC", text)  # O and a combining tilde become one searchable Õ


def _wrap(text: str) -> str:
    return text if _SIMPLE.fullmatch(text) else f"({text})"


def _skip_spaces(tokens: list[str], i: int) -> int:
    while i < len(tokens) and tokens[i].isspace():
        i += 1
    return i


def _argument(tokens: list[str], i: int) -> tuple[str, int]:
    """One macro argument or script: a {group}, else the next single token."""
    i = _skip_spaces(tokens, i)
    if i >= len(tokens):
        return "", i
    if tokens[i] == "{":
        text, i = _convert(tokens, i + 1, stop="}")
        return text.strip(), i + 1
    return _convert_one(tokens, i)


def _convert(tokens: list[str], i: int, stop: str | None) -> tuple[str, int]:
    out = []
    while i < len(tokens) and tokens[i] != stop:
        text, i = _convert_one(tokens, i)
        out.append(text)
    return "".join(out), i


def _convert_one(tokens: list[str], i: int) -> tuple[str, int]:
    token = tokens[i]
    i += 1
    if token == "{":
        text, i = _convert(tokens, i, stop="}")
        return text, i + 1
    if token in "^_":
        text, i = _argument(tokens, i)
        return token + _wrap(text) if text else "", i
    if token == "&":
        return "", i
    if token == "~":
        return " ", i
    if not token.startswith("\\"):
        return token, i
    name = token[1:]
    if name in FRACTIONS:
        top, i = _argument(tokens, i)
        bottom, i = _argument(tokens, i)
        return f"{_wrap(top)}/{_wrap(bottom)}", i
    if name == "sqrt":
        text, i = _argument(tokens, i)
        return "√" + _wrap(text), i
    if name == "underbrace":
        text, i = _argument(tokens, i)
        j = _skip_spaces(tokens, i)
        if j < len(tokens) and tokens[j] == "_":  # the brace's label is not part of the formula
            _, i = _argument(tokens, j + 1)
        return text, i
    if name in COMBINING:
        text, i = _argument(tokens, i)
        return (text + COMBINING[name]) if len(text) == 1 else text, i
    if name in TEXT_ARGUMENT:
        return _argument(tokens, i)
    if name in DROPPED_ARGUMENT:
        _, i = _argument(tokens, i)
        return "", i
    if name in IGNORED:
        j = _skip_spaces(tokens, i)
        if j < len(tokens) and tokens[j] == ".":  # \left. is an invisible delimiter
            i = j + 1
        return "", i
    if name in SYMBOLS:
        word = SYMBOLS[name]
        if word in _SPACED:
            return f" {word} ", i
        if len(word) > 1 and word.isalpha() and i < len(tokens) and (tokens[i].isalnum() or tokens[i][0] == "\\"):
            word += " "  # \log\ell reads "log ℓ", not "logℓ"
        return word, i
    return name, i  # an unknown macro: its name, never a backslash


# --- HTML for the index ----------------------------------------------------------------------------

_ARITHMATEX = re.compile(r'<(?P<tag>span|div) class="arithmatex">(?P<tex>.*?)</(?P=tag)>', re.S)
_DELIMITED = re.compile(r"\$\$(?P<a>.+?)\$\$|\\\[(?P<b>.+?)\\\]|\\\((?P<c>.+?)\\\)|\$(?P<d>[^$]+?)\$", re.S)
_NOTEBOOK_MARKDOWN = re.compile(r'(<div class="[^"]*\bjp-RenderedMarkdown\b[^"]*"[^>]*>)(.*?)(</div>)', re.S)
_NOTEBOOK_CHROME = [
    re.compile(r'<div class="jp-(?:In|Out)putPrompt[^"]*">[^<]*</div>'),  # In [4]: / Out[4]:
    re.compile(r'<span class="notice"[^>]*>Copied!</span>'),  # the copy button's notice
    re.compile(r'<div class="clipboard-copy-txt"[^>]*>[^<]*</div>'),  # the copy button's hidden copy of the cell
    re.compile(r'<a class="anchor-link"[^>]*>[^<]*</a>'),  # the ¶ after a notebook heading
]


def _arithmatex_to_text(match: re.Match) -> str:
    tex = unescape(match.group("tex")).strip()
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):  # arithmatex's generic delimiters
        if tex.startswith(left) and tex.endswith(right):
            tex = tex[len(left):-len(right)]
    return escape(tex_to_text(tex), quote=False)


def _delimited_to_text(match: re.Match) -> str:
    tex = next(group for group in match.groups() if group is not None)
    return escape(tex_to_text(unescape(tex)), quote=False)


def math_as_text(html: str) -> str:
    """Every arithmatex formula in ``html``, and every delimited one in notebook markdown, as plain text."""
    html = _ARITHMATEX.sub(_arithmatex_to_text, html)
    def cell(m: re.Match) -> str:
        return m.group(1) + _DELIMITED.sub(_delimited_to_text, m.group(2)) + m.group(3)

    return _NOTEBOOK_MARKDOWN.sub(cell, html)


def strip_notebook_chrome(html: str) -> str:
    for pattern in _NOTEBOOK_CHROME:
        html = pattern.sub("", html)
    return html


def search_html(html: str) -> str:
    """What the search plugin should read instead of the page's HTML."""
    return strip_notebook_chrome(math_as_text(html))


# --- the swap around the search plugin (priority 0) ------------------------------------------------


@event_priority(50)
def _show_search_html(context, page, config, nav):
    page._displayed_content = page.content
    page.content = search_html(page.content)
    return context


@event_priority(-50)
def _restore_page_html(context, page, config, nav):
    # The HTML as it was before the search plugin ran. (The plugin also strips data-search-* attributes
    # from what it read; no page here uses them.)
    page.content = page.__dict__.pop("_displayed_content", page.content)
    return context


on_page_context = CombinedEvent(_show_search_html, _restore_page_html)
