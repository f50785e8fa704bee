"""The embedded default text corpus: real Wikipedia articles, cleaned to plain prose.

The dump is the shortened enwiki export that ships inside the gensim wheel (206 pages, about half
of them redirects). We only read the file, never import gensim: its numpy/scipy pins are not
installed and nothing here needs its code.

`clean_wiki_markup` is a small, linear-time approximation of MediaWiki rendering: brace and bracket
nesting is matched with explicit stacks rather than regexes (regexes cannot count nesting and
backtrack badly on 100+ KB pages), and every regex's character classes stop at the next
delimiter, so a failed match never rescans the rest of the page.
"""

from __future__ import annotations

import bz2
import hashlib
import html
import importlib.util
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from qnpu_jax.data.cache import cached_bytes, digest
from qnpu_jax.errors import QnpuError

WIKI_DUMP_RELPATH = Path(
    "test", "test_data", "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
SPLITS = ("calib", "eval", "all")
MIN_PAGE_CHARS = 200

# Sections after which an article is lists of citations and links, not prose.
NON_PROSE_SECTIONS = frozenset(
    {
        "see also",
        "references",
        "notes",
        "further reading",
        "external links",
        "bibliography",
        "sources",
        "footnotes",
        "citations",
        "works cited",
        "notes and references",
        "references and notes",
    }
)

# Tags whose content is not prose (formulas, citations, image lists, code): dropped whole.
DROP_CONTENT_TAGS = (
    "ref",
    "references",
    "math",
    "chem",
    "ce",
    "gallery",
    "timeline",
    "score",
    "syntaxhighlight",
    "source",
    "imagemap",
    "hiero",
    "graph",
    "mapframe",
    "maplink",
    "templatedata",
    "inputbox",
    "categorytree",
)
# Formatting tags: the tag goes, the text inside stays.
KEEP_CONTENT_TAGS = (
    "sub",
    "sup",
    "small",
    "big",
    "span",
    "div",
    "blockquote",
    "center",
    "p",
    "i",
    "b",
    "u",
    "s",
    "strike",
    "del",
    "ins",
    "em",
    "strong",
    "font",
    "code",
    "tt",
    "var",
    "kbd",
    "samp",
    "abbr",
    "cite",
    "q",
    "poem",
    "onlyinclude",
    "includeonly",
    "noinclude",
    "section",
    "table",
    "tr",
    "td",
    "th",
    "caption",
    "ul",
    "ol",
    "li",
    "dl",
    "dt",
    "dd",
    "hr",
    "wbr",
)
# Link namespaces that render as images or page metadata, not as text.
DROP_LINK_NAMESPACES = frozenset({"file", "image", "category"})


@dataclass(frozen=True)
class WikiPage:
    title: str
    text: str


def wiki_dump_path() -> Path:
    """Path of the Wikipedia dump inside the installed gensim package (gensim is not imported)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise QnpuError(
            "the default text corpus is the Wikipedia dump shipped in the gensim wheel, but "
            "gensim is not installed: pip install --no-deps gensim"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / WIKI_DUMP_RELPATH
    if not path.is_file():
        raise QnpuError(
            f"the installed gensim has no Wikipedia dump at {path}; reinstall the full wheel: "
            "pip install --no-deps --force-reinstall gensim"
        )
    return path


# --------------------------------------------------------------------------------------------
# Tags and comments
# --------------------------------------------------------------------------------------------


def _strip_comments(text: str) -> str:
    # An unclosed comment runs to the end of the page, as MediaWiki renders it.
    out: list[str] = []
    pos = 0
    while (start := text.find("<!--", pos)) != -1:
        out.append(text[pos:start])
        end = text.find("-->", start + 4)
        if end == -1:
            return "".join(out)
        pos = end + 3
    out.append(text[pos:])
    return "".join(out)


_CLOSE_TAG_RES = {
    name: re.compile(rf"</\s*{name}\s*>", re.IGNORECASE)
    for name in (*DROP_CONTENT_TAGS, "nowiki", "pre")
}
_LITERAL_TAG_RE = re.compile(r"<(nowiki|pre)(\s[^<>]*)?>", re.IGNORECASE)
_MARKUP_CHARS = str.maketrans(
    {c: f"&#{ord(c)};" for c in "[]{}|'<>=*#:;_~"}  # re-created by html.unescape at the end
)


def _escape_literal_tags(text: str) -> str:
    """Keep <nowiki>/<pre> content verbatim by entity-escaping the characters markup uses."""
    out: list[str] = []
    pos = 0
    no_close: set[str] = set()
    for m in _LITERAL_TAG_RE.finditer(text):
        if m.start() < pos:  # inside an earlier nowiki span
            continue
        out.append(text[pos : m.start()])
        attrs = m.group(2) or ""
        if attrs.rstrip().endswith("/"):  # <nowiki/> is just a separator
            pos = m.end()
            continue
        name = m.group(1).lower()
        close = None if name in no_close else _CLOSE_TAG_RES[name].search(text, m.end())
        if close is None:  # unclosed: drop the opening tag; never search for this name again
            no_close.add(name)
            pos = m.end()
            continue
        out.append(text[m.end() : close.start()].translate(_MARKUP_CHARS))
        pos = close.end()
    out.append(text[pos:])
    return "".join(out)


_DROP_TAG_RE = re.compile(rf"<({'|'.join(DROP_CONTENT_TAGS)})\b([^<>]*)>", re.IGNORECASE)


def _drop_content_tags(text: str) -> str:
    out: list[str] = []
    pos = 0
    no_close: set[str] = set()  # names with no closing tag left: never search for them again
    for m in _DROP_TAG_RE.finditer(text):
        if m.start() < pos:
            continue
        out.append(text[pos : m.start()])
        pos = m.end()
        name = m.group(1).lower()
        if m.group(2).rstrip().endswith("/") or name in no_close:  # <ref name="x"/>
            continue
        close = _CLOSE_TAG_RES[name].search(text, m.end())
        if close is None:
            no_close.add(name)  # unclosed: drop only the opening tag, keep the text
            continue
        pos = close.end()
    out.append(text[pos:])
    # Stray closing tags of dropped elements (e.g. a </ref> without its opening).
    return re.sub(rf"</\s*(?:{'|'.join(DROP_CONTENT_TAGS)})\s*>", "", "".join(out), flags=re.I)


_KEEP_TAG_RE = re.compile(rf"</?(?:{'|'.join(KEEP_CONTENT_TAGS)})\b[^<>]*>", re.IGNORECASE)
_BR_RE = re.compile(r"</?br\b[^<>]*>", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------------

_MONTHS = (
    *("January", "February", "March", "April", "May", "June", "July"),
    *("August", "September", "October", "November", "December"),
)
_NDASH, _MDASH = "\u2013", "\u2014"
_CONVERT_RANGE_WORDS = frozenset({"to", "-", _NDASH, "and", "or", "by", "x", "\u00d7", "+"})
_CONVERT_UNITS = {"C": "°C", "F": "°F", "K": "K", "sqmi": "sq mi", "sqkm": "km²", "km2": "km²"}
_ARG_NAME_RE = re.compile(r"[\w -]+")


def _split_args(inner: str) -> list[str]:
    """Split template text on '|' outside [[links]] (nested templates are already rendered)."""
    parts: list[str] = []
    depth = 0
    start = 0
    i = 0
    n = len(inner)
    while i < n:
        two = inner[i : i + 2]
        if two == "[[":
            depth += 1
            i += 2
        elif two == "]]" and depth:
            depth -= 1
            i += 2
        elif inner[i] == "|" and depth == 0:
            parts.append(inner[start:i])
            start = i = i + 1
        else:
            i += 1
    parts.append(inner[start:])
    return parts


def _month(value: str) -> str:
    value = value.strip()
    return _MONTHS[int(value) - 1] if value.isdigit() and 1 <= int(value) <= 12 else value


def _render_convert(pos: list[str]) -> str:
    if len(pos) >= 4 and pos[1].strip() in _CONVERT_RANGE_WORDS:
        sep = _NDASH if pos[1].strip() in {"-", _NDASH} else f" {pos[1].strip()} "
        value, unit = f"{pos[0].strip()}{sep}{pos[2].strip()}", pos[3].strip()
    elif len(pos) >= 2:
        value, unit = pos[0].strip(), pos[1].strip()
    else:
        return pos[0] if pos else ""
    return f"{value} {_CONVERT_UNITS.get(unit, unit)}"


def _render_date(pos: list[str]) -> str:
    parts = [p.strip() for p in pos[:3]]
    if len(parts) == 3 and all(p.isdigit() for p in parts):
        return f"{int(parts[2])} {_month(parts[1])} {parts[0]}"
    return " ".join(parts)


def _render_as_of(pos: list[str], named: dict[str, str]) -> str:
    when = " ".join(p for p in (_month(pos[1]) if len(pos) > 1 else "", pos[0] if pos else "") if p)
    lead = "as of" if named.get("lc", "").strip() else "As of"
    return f"{lead} {when}".strip()


def _first(pos: list[str]) -> str:
    return pos[0] if pos else ""


def _quote_text(pos: list[str], named: dict[str, str]) -> str:
    return named.get("text", named.get("quote", _first(pos)))


# Inline templates that render as words inside a sentence. Dropping them would break the
# sentence ("a distance of  from"), so render the common ones; all others (citations, infoboxes,
# navboxes, maintenance tags, pronunciations) render as nothing.
_Renderer = Callable[[list[str], dict[str, str]], str]
_INLINE_TEMPLATES: dict[str, _Renderer] = {
    "convert": lambda p, n: _render_convert(p),
    "cvt": lambda p, n: _render_convert(p),
    "lang": lambda p, n: p[1] if len(p) > 1 else "",
    "transl": lambda p, n: p[-1] if len(p) > 1 else "",
    "transliteration": lambda p, n: p[-1] if len(p) > 1 else "",
    "nihongo": lambda p, n: (p[0] or (p[2] if len(p) > 2 else "")) if p else "",
    "as of": _render_as_of,
    "birth date": lambda p, n: _render_date(p),
    "death date": lambda p, n: _render_date(p),
    "birth date and age": lambda p, n: _render_date(p),
    "death date and age": lambda p, n: _render_date(p),
    "start date": lambda p, n: _render_date(p),
    "end date": lambda p, n: _render_date(p),
    "dts": lambda p, n: _render_date(p),
    "frac": lambda p, n: f"{p[0]} {p[1]}/{p[2]}" if len(p) > 2 else "/".join(p),
    "angbr": lambda p, n: f"⟨{_first(p)}⟩",
    "keypress": lambda p, n: "+".join(p),
    "chem": lambda p, n: "".join(p),
    "quote": _quote_text,
    "cquote": _quote_text,
    "quotation": _quote_text,
    "blockquote": _quote_text,
    "circa": lambda p, n: f"c. {_first(p)}".strip(),
    "c.": lambda p, n: f"c. {_first(p)}".strip(),
    "sic": lambda p, n: p[-1] if p else "",
    # As entities, so that a following '' is not read as bold (MediaWiki does the same).
    "'s": lambda p, n: "&#39;s",
    "'": lambda p, n: "&#39;",
    "nbsp": lambda p, n: " ",
    "snd": lambda p, n: f" {_NDASH} ",
    "spaced ndash": lambda p, n: f" {_NDASH} ",
    "ndash": lambda p, n: _NDASH,
    "mdash": lambda p, n: _MDASH,
    "mdashb": lambda p, n: _MDASH,
    "ndashb": lambda p, n: _NDASH,
    "!": lambda p, n: "|",
    "pipe": lambda p, n: "|",
    "·": lambda p, n: " · ",
}
for _name in (
    *("nowrap", "nobr", "small", "smaller", "larger", "big", "sc", "smallcaps", "em", "strong"),
    *("vanchor", "math", "mvar", "var", "sub", "sup", "abbr", "ill", "nts", "val", "vr", "nq"),
    *("flag", "flagcountry", "flagu", "formatnum", "lc", "uc", "lower", "upper"),
):
    _INLINE_TEMPLATES[_name] = lambda p, n: _first(p)
_INLINE_TEMPLATES["visible anchor"] = _INLINE_TEMPLATES["vanchor"]
_INLINE_TEMPLATES["small caps"] = _INLINE_TEMPLATES["sc"]


def _render_template(inner: str) -> str:
    head, has_args, arg_text = inner.partition("|")
    head = head.strip()
    for prefix in ("subst:", "safesubst:", "msgnw:"):
        if head.lower().startswith(prefix):
            head = head[len(prefix) :]
    args: list[str] = []
    if ":" in head:  # parser function or magic word: {{formatnum:1,234}}, {{#if:...}}
        head, _, first_arg = head.partition(":")
        args.append(first_arg)
    name = " ".join(head.replace("_", " ").split()).lower()
    # Most templates (citations, infoboxes) render as nothing: skip splitting their arguments.
    if not (name.startswith("lang-") or name in _INLINE_TEMPLATES):
        return ""
    if has_args:
        args.extend(_split_args(arg_text))
    pos: list[str] = []
    named: dict[str, str] = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if eq and key.strip() and _ARG_NAME_RE.fullmatch(key):
            named[key.strip().lower()] = value.strip()
        else:
            pos.append(arg.strip())
    if name.startswith("lang-"):  # {{lang-fr|texte}}
        return _first(pos)
    return _INLINE_TEMPLATES[name](pos, named)


_BRACE_RUN_RE = re.compile(r"\{\{+|\}\}+")


def _expand_templates(text: str) -> str:
    """Replace every {{template}} and {{{parameter}}} with its rendering, innermost first.

    Follows MediaWiki's preprocessor: runs of braces are matched as units, a close run takes
    three braces (a parameter) when both runs have three, else two (a template); unmatched braces
    stay literal. One pass over the brace runs, so linear in the page length.
    """
    # Each open frame: [braces still open, pieces of rendered content].
    stack: list[list] = []
    top: list[str] = []  # pieces at depth 0
    pos = 0

    def emit(piece: str) -> None:
        (stack[-1][1] if stack else top).append(piece)

    for m in _BRACE_RUN_RE.finditer(text):
        emit(text[pos : m.start()])
        pos = m.end()
        run = m.group()
        if run[0] == "{":
            stack.append([len(run), []])
            continue
        closing = len(run)
        while closing >= 2 and stack:
            frame = stack[-1]
            k = 3 if frame[0] >= 3 and closing >= 3 else 2
            inner = "".join(frame[1])
            rendered = "" if k == 3 else _render_template(inner)  # {{{param}}} -> nothing
            frame[0] -= k
            closing -= k
            if frame[0] >= 2:
                frame[1] = [rendered]
            else:
                stack.pop()
                emit("{" * frame[0] + rendered)
        emit("}" * closing)
    emit(text[pos:])
    # Unclosed braces are literal text. Each frame holds the text up to the next frame's
    # opening, so flattening in stack order restores the text without quadratic re-nesting.
    for count, pieces in stack:
        top.append("{" * count)
        top.extend(pieces)
    return "".join(top)


# --------------------------------------------------------------------------------------------
# Tables and links
# --------------------------------------------------------------------------------------------


def _drop_tables(text: str) -> str:
    # Tables open with '{|' and close with '|}' at the start of a line (after indentation);
    # MediaWiki closes unclosed tables at the end of the page, so an unclosed one runs to it.
    out: list[str] = []
    depth = 0
    for line in text.split("\n"):
        head = line.lstrip(" \t:")
        if head.startswith("{|"):
            depth += 1
        elif depth and head.startswith("|}"):
            depth -= 1
        elif not depth:
            out.append(line)
    return "\n".join(out)


_EXT_LINK_RE = re.compile(
    r"\[(?:(?:https?|ftps?|irc|ircs|news|mailto|gopher|nntp|telnet|svn|git|sftp|ssh):|//)"
    # The label excludes '[' so that an unclosed link's scan stops at the next link (linear).
    r"[^\s\[\]<>\"]+(?:[ \t]+([^\[\]\n]*))?\]",
    re.IGNORECASE,
)
_LINK_RUN_RE = re.compile(r"\[\[+|\]\]+")
_INTERLANGUAGE_RE = re.compile(r"^[a-z]{2,3}(?:-[a-z]+)*$")
_PAREN_SUFFIX_RE = re.compile(r"\s*\([^()]*\)$")


def _render_link(inner: str) -> str:
    target, pipe, label = inner.partition("|")
    target = target.strip()
    prefix, colon, _ = target.partition(":")
    namespace = prefix.strip().lower().replace("_", " ")
    # A leading ':' ([[:Category:X]]) makes a visible link instead of page metadata.
    dropped = namespace in DROP_LINK_NAMESPACES or _INTERLANGUAGE_RE.match(namespace)
    if colon and dropped and not target.startswith(":"):
        return ""
    target = target.lstrip(":")
    if not pipe:
        return target
    if label.strip():
        return label
    # Pipe trick: [[Paris, Texas|]] -> "Paris", [[Help:Contents|]] -> "Contents".
    shown = target.split(":", 1)[-1] if colon else target
    return _PAREN_SUFFIX_RE.sub("", shown).split(",")[0].strip()


def _render_links(text: str) -> str:
    """Replace [[links]] by their text; drop file, category and interlanguage links whole.

    Stack-matched so a file caption's own [[links]] are dropped with it. Text following a link
    stays glued to its label, which renders MediaWiki's link trail ([[bus]]es -> buses).
    """
    stack: list[list[str]] = []
    top: list[str] = []
    pos = 0

    def emit(piece: str) -> None:
        (stack[-1] if stack else top).append(piece)

    for m in _LINK_RUN_RE.finditer(text):
        emit(text[pos : m.start()])
        pos = m.end()
        run = m.group()
        # '[[[x]]' is '[' + link and 'x]]]' is link + ']': the pairs sit innermost.
        extra, pairs = len(run) % 2, len(run) // 2
        if run[0] == "[":
            emit("[" * extra)
            stack.extend([] for _ in range(pairs))
            continue
        for _ in range(pairs):
            if not stack:
                break  # an unmatched ']]' is dropped
            emit(_render_link("".join(stack.pop())))
        emit("]" * extra)
    emit(text[pos:])
    for pieces in stack:  # unclosed links are literal text (see _expand_templates)
        top.append("[[")
        top.extend(pieces)
    return "".join(top)


# --------------------------------------------------------------------------------------------
# Lines: headings, lists, non-prose sections
# --------------------------------------------------------------------------------------------

_QUOTES_RE = re.compile(r"'{2,}")
_MAGIC_WORD_RE = re.compile(r"__[A-Z]+__")
_HEADING_RE = re.compile(r"^(={1,6})(.+?)(={1,6})[ \t]*$")
_LIST_MARKER_RE = re.compile(r"^[*#:;]+[ \t]*")
_LETTER_RE = re.compile(r"[^\W\d_]")
_LEFTOVER_MARKUP_RE = re.compile(r"\[\[|\]\]|\{\{|\}\}|\{\||\|\}|'{3,}")


def _strip_quotes_line(line: str) -> str:
    """Remove '' / ''' / ''''' markup from one line, keeping the apostrophes MediaWiki keeps.

    MediaWiki balances quotes per line: with an odd number of both italics and bolds, one
    ''' is really an apostrophe followed by '' (''Proposal'''s -> italic "Proposal's").
    """
    runs = list(_QUOTES_RE.finditer(line))
    if not runs:
        return line
    kept: list[str] = []  # literal apostrophes each run leaves behind
    kinds: list[int] = []  # 2 italic, 3 bold, 5 both, 0 no toggle
    for m in runs:
        n = len(m.group())
        after_letter = m.start() > 0 and line[m.start() - 1].isalpha()
        if n == 4:  # apostrophe + bold after a word; else what ''{{template}}'' left behind
            kept.append("'" if after_letter else "")
            kinds.append(3 if after_letter else 0)
        else:
            kept.append("'" * max(0, n - 5))
            kinds.append(min(n, 5))
    italics = sum(k in (2, 5) for k in kinds)
    bolds = sum(k in (3, 5) for k in kinds)
    if italics % 2 and bolds % 2:
        # Prefer a bold after a one-letter word, then after a longer word, then after a space.
        best: tuple[int, int] | None = None
        for i, m in enumerate(runs):
            if kinds[i] != 3:
                continue
            before = line[m.start() - 1] if m.start() > 0 else " "
            before2 = line[m.start() - 2] if m.start() > 1 else " "
            rank = 2 if before == " " else 0 if before2 == " " else 1
            if best is None or rank < best[0]:
                best = (rank, i)
        if best is not None:
            kept[best[1]] += "'"
    out: list[str] = []
    pos = 0
    for m, literal in zip(runs, kept, strict=True):
        out.append(line[pos : m.start()])
        out.append(literal)
        pos = m.end()
    out.append(line[pos:])
    return "".join(out)


def _process_lines(text: str) -> list[tuple[int, str]]:
    """Lines as (heading level, text), level 0 for body text; non-prose sections are cut."""
    items: list[tuple[int, str]] = []
    cut_level = 0  # >0 while inside a non-prose section of that level
    for raw in text.split("\n"):
        line = raw.strip()
        heading = _HEADING_RE.match(line)
        if heading and heading.group(2).strip(" ="):
            level = min(len(heading.group(1)), len(heading.group(3)))
            title = heading.group(2).strip(" =")
            if cut_level and level > cut_level:
                continue
            is_cut = title.rstrip(":").strip().lower() in NON_PROSE_SECTIONS
            cut_level = level if is_cut else 0
            if not is_cut:
                items.append((level, title))
            continue
        if not cut_level:
            items.append((0, _LIST_MARKER_RE.sub("", line)))
    return items


_SPACES_RE = re.compile(r"[ \t\u00a0\u2009\u202f]+")
_SPACE_BEFORE_PUNCT_RE = re.compile(r" +(?!\.\.\.)([,.;:!?)])")
_SPACE_AFTER_PAREN_RE = re.compile(r"([(]) +")
_EMPTY_PARENS_RE = re.compile(r" \(\s*\)")
_PAREN_LEADING_SEP_RE = re.compile(r"\(\s*[,;]\s*")
_PAREN_TRAILING_SEP_RE = re.compile(r"\s*[,;]\s*\)")
_REPEATED_PUNCT_RE = re.compile(r"([,;])(?:\s*[,;])+")


def _tidy_line(line: str) -> str:
    # Removing refs and templates leaves "word ,", "( ; x)" and "()" behind.
    line = _SPACES_RE.sub(" ", line)
    line = _REPEATED_PUNCT_RE.sub(r"\1", line)
    line = _PAREN_LEADING_SEP_RE.sub("(", line)
    line = _PAREN_TRAILING_SEP_RE.sub(")", line)
    line = _EMPTY_PARENS_RE.sub("", line)
    line = _SPACE_AFTER_PAREN_RE.sub(r"\1", line)
    line = _SPACE_BEFORE_PUNCT_RE.sub(r"\1", line)
    return _SPACES_RE.sub(" ", line).strip()


def clean_wiki_markup(markup: str) -> str:
    """Render MediaWiki wikitext as plain prose: paragraphs separated by one blank line.

    Citations, templates (except a few inline ones that carry words), tables, images,
    categories, formulas and the trailing reference/link sections are dropped; links become their
    labels; headings become a line of their own.
    """
    text = markup.replace("\r\n", "\n").replace("\r", "\n")
    text = _strip_comments(text)
    text = _escape_literal_tags(text)
    text = _drop_content_tags(text)
    text = _expand_templates(text)
    text = _drop_tables(text)
    text = _EXT_LINK_RE.sub(lambda m: m.group(1) or "", text)
    text = _render_links(text)
    text = "\n".join(_strip_quotes_line(line) for line in text.split("\n"))
    text = _BR_RE.sub("\n", text)
    text = _KEEP_TAG_RE.sub("", text)
    text = _MAGIC_WORD_RE.sub("", text)

    # Blocks: (heading level, text) for headings, (0, paragraph) for body text.
    blocks: list[tuple[int, str]] = []
    current: list[str] = []
    for level, raw_line in _process_lines(text):
        line = _tidy_line(_LEFTOVER_MARKUP_RE.sub("", html.unescape(raw_line)))
        if (level or not line) and current:  # headings and blank lines end a paragraph
            blocks.append((0, "\n".join(current)))
            current = []
        if line and _LETTER_RE.search(line):
            if level:
                blocks.append((level, line))
            else:
                current.append(line)
    if current:
        blocks.append((0, "\n".join(current)))
    # Drop headings left with no prose under them (sections that were all tables or images).
    # Walking backwards, prose_next[lv] says whether the next block that is body text or a
    # heading of level <= lv is body text (deeper subheadings do not end a section).
    kept: list[str] = []
    prose_next = [False] * 7
    for level, block in reversed(blocks):
        if not level:
            prose_next = [True] * 7
            kept.append(block)
            continue
        if prose_next[min(level, 6)]:
            kept.append(block)
        for lv in range(level, 7):
            prose_next[lv] = False
    return "\n\n".join(reversed(kept))


# --------------------------------------------------------------------------------------------
# Dump parsing and splits
# --------------------------------------------------------------------------------------------

_DISAMBIG_TEMPLATE_RE = re.compile(
    r"\{\{\s*(?:disambig|disambiguation|dab|hndis|geodis)\s*[|}]", re.IGNORECASE
)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _open_dump(path: Path) -> IO[bytes]:
    with open(path, "rb") as f:
        magic = f.read(3)
    # bz2 by content, not by name, so a plain .xml export works too.
    return bz2.open(path, "rb") if magic == b"BZh" else open(path, "rb")


def _page_fields(page: ET.Element) -> tuple[str, str, bool, str]:
    title, ns, text, redirect = "", "0", "", False
    for child in page.iter():
        name = _local(child.tag)
        if name == "title":
            title = child.text or ""
        elif name == "ns":
            ns = (child.text or "0").strip()
        elif name == "redirect":
            redirect = True
        elif name == "text":  # the last revision wins in a multi-revision export
            text = child.text or ""
    return title, ns, redirect, text


def parse_wiki_dump(path: Path) -> list[WikiPage]:
    """Articles (namespace 0, not redirects or disambiguations) of a MediaWiki XML export.

    Pages whose cleaned text is under MIN_PAGE_CHARS characters are skipped. File order is kept.
    """
    path = Path(path)
    pages: list[WikiPage] = []
    seen_page = False
    try:
        with _open_dump(path) as f:
            root: ET.Element | None = None
            for event, elem in ET.iterparse(f, events=("start", "end")):
                if root is None:
                    root = elem
                if event != "end" or _local(elem.tag) != "page":
                    continue
                seen_page = True
                title, ns, redirect, markup = _page_fields(elem)
                # Drop finished pages from the tree so memory stays flat on large dumps.
                root.clear()
                if ns != "0" or redirect or markup.lstrip()[:9].lower() == "#redirect":
                    continue
                if title.endswith("(disambiguation)") or _DISAMBIG_TEMPLATE_RE.search(markup):
                    continue
                text = clean_wiki_markup(markup)
                if len(text) >= MIN_PAGE_CHARS:
                    pages.append(WikiPage(title=title, text=text))
    except (ET.ParseError, OSError, EOFError) as exc:
        raise QnpuError(f"cannot read the Wikipedia dump {path}: {exc}") from exc
    if not seen_page:
        raise QnpuError(f"{path} is not a MediaWiki XML export: it has no <page> elements")
    return pages


def _in_eval(title: str, eval_fraction: float) -> bool:
    # A hash of the title, not the file position, so a page keeps its side when the dump changes.
    digest = hashlib.sha256(title.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def split_pages(pages: Sequence[WikiPage], eval_fraction: float = 0.2) -> dict[str, list[WikiPage]]:
    """Deterministic calib/eval split by title hash; order is preserved within each side."""
    if not 0.0 < eval_fraction < 1.0:
        raise QnpuError(f"eval_fraction must be between 0 and 1 (exclusive), got {eval_fraction}")
    splits: dict[str, list[WikiPage]] = {"calib": [], "eval": []}
    for page in pages:
        splits["eval" if _in_eval(page.title, eval_fraction) else "calib"].append(page)
    for name, side in splits.items():
        if not side:
            raise QnpuError(
                f"splitting {len(pages)} pages with eval_fraction={eval_fraction} leaves the "
                f"{name!r} split empty"
            )
    return splits


def cached_wiki_pages(path: Path) -> list[WikiPage]:
    """`parse_wiki_dump(path)` through the data cache (`data.cache`), keyed by the dump's bytes
    and this parser's source: parsing gensim's dump takes seconds of Python on a slow CPU."""
    try:
        key = digest(path.read_bytes(), Path(__file__).read_bytes())
    except OSError:
        return parse_wiki_dump(path)  # it names what cannot be read
    payload = cached_bytes(
        "wiki-pages",
        key,
        lambda: json.dumps([[p.title, p.text] for p in parse_wiki_dump(path)]).encode(),
    )
    return [WikiPage(title=title, text=text) for title, text in json.loads(payload)]


def load_wiki(split: str = "all", path: Path | None = None) -> list[str]:
    """Page texts of the 'calib', 'eval' or 'all' split of the dump (default: gensim's), parsed
    once per dump and parser (`cached_wiki_pages`)."""
    if split not in SPLITS:
        raise QnpuError(f"unknown Wikipedia split {split!r}; valid splits: {', '.join(SPLITS)}")
    pages = cached_wiki_pages(wiki_dump_path() if path is None else Path(path))
    chosen = pages if split == "all" else split_pages(pages)[split]
    return [page.text for page in chosen]
