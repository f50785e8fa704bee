"""The Wikipedia corpus: markup cleaning on small hand-written cases, then the real gensim dump."""

from __future__ import annotations

import bz2
import re
from pathlib import Path

import pytest

from qnpu_jax.data.wiki import (
    WikiPage,
    clean_wiki_markup,
    load_wiki,
    parse_wiki_dump,
    split_pages,
    wiki_dump_path,
)
from qnpu_jax.errors import QnpuError

PROSE = "This sentence is long enough to count as prose for the minimum page length. " * 4


# ------------------------------------------------------------------------------------------
# clean_wiki_markup
# ------------------------------------------------------------------------------------------


def test_nested_templates_are_dropped_whole() -> None:
    markup = "Foo {{a|x={{b|{{c|d}}}}|e}} bar{{citation needed|date=May 2015}} baz."
    assert clean_wiki_markup(markup) == "Foo bar baz."


def test_multiline_infobox_with_links_and_files_is_dropped() -> None:
    markup = (
        "{{Infobox country\n| name = X\n| image = [[File:a.jpg|100px]]\n"
        "| capital = [[Paris]] {{small|(city)}}\n}}\n'''X''' is a country."
    )
    assert clean_wiki_markup(markup) == "X is a country."


def test_template_parameters_and_stray_braces() -> None:
    assert clean_wiki_markup("a {{{1|default}}} b }} c") == "a b c"


def test_unclosed_template_keeps_the_text() -> None:
    assert clean_wiki_markup("Start {{unclosed template then prose") == (
        "Start unclosed template then prose"
    )


def test_inline_templates_that_carry_words_are_rendered() -> None:
    markup = (
        "It is {{convert|5|km|mi}} long, {{convert|10|to|20|mi|km|abbr=on}} wide; "
        "{{lang|fr|bonjour}} and {{lang-de|Hallo}}; {{nowrap|{{convert|3|ft|m}}}}."
    )
    assert clean_wiki_markup(markup) == (
        "It is 5 km long, 10 to 20 mi wide; bonjour and Hallo; 3 ft."
    )


def test_file_links_with_links_in_captions_are_dropped_whole() -> None:
    markup = (
        "See [[File:X.jpg|thumb|left|A [[cat]] and [[dog|dogs]] {{y}} [http://a.org b]]] "
        "here.[[Image:Y.png|[[Z]]]] [[image:lower.png]] Done."
    )
    assert clean_wiki_markup(markup) == "See here. Done."


def test_category_and_interlanguage_links_are_dropped() -> None:
    markup = (
        "Text [[Category:Cats|Sort]] here.\n[[Category:Animals]]\n[[de:Katze]] [[zh-min-nan:Niau]]"
    )
    assert clean_wiki_markup(markup) == "Text here."


def test_internal_links_render_labels_targets_and_trails() -> None:
    markup = (
        "The [[bus]]es, [[Paris|the capital]], [[Paris, Texas|]], [[Foo (bar)|]], "
        "[[:Category:Cats]] and [[wikt:word|a word]]."
    )
    assert clean_wiki_markup(markup) == (
        "The buses, the capital, Paris, Foo, Category:Cats and a word."
    )


def test_external_links() -> None:
    markup = "[http://x.org Label text] and [https://y.org] and [//z.org relative] end."
    assert clean_wiki_markup(markup) == "Label text and and relative end."


def test_bracket_runs_next_to_links() -> None:
    assert clean_wiki_markup("[[[a]]] and [[b|c]]] and x]] y") == "[a] and c] and x y"


def test_tables_including_nested_ones_are_dropped() -> None:
    markup = (
        'Before.\n{| class="wikitable"\n|-\n! A !! B\n|-\n| a || b\n'
        "{|\n| inner || [[x]]\n|}\n| c\n|}\nAfter."
    )
    assert clean_wiki_markup(markup) == "Before.\nAfter."


def test_refs_are_dropped_with_their_content() -> None:
    markup = (
        'Claim.<ref name="a">Smith, {{cite web|url=http://x|title=T}}</ref> More'
        '<ref name=b/> end.<REF>upper</REF><ref group="n" >g</ref>'
    )
    assert clean_wiki_markup(markup) == "Claim. More end."


def test_html_tags_keep_formatting_text_and_drop_formulas() -> None:
    markup = (
        "Water is H<sub>2</sub>O, x<sup>2</sup>, <small>small</small>, "
        '<span style="color:red">red</span> and <math>x^2 + y</math>ok.'
        "<blockquote>Quoted.</blockquote>"
        "<gallery>\nFile:a.jpg|caption\n</gallery>"
        "<syntaxhighlight lang=python>print(1)</syntaxhighlight>"
    )
    assert clean_wiki_markup(markup) == "Water is H2O, x2, small, red and ok.Quoted."


def test_bold_and_italic_quotes_are_removed() -> None:
    markup = "'''Bold''' and ''italic'' and '''''both''''' and l''''amour''' and it's."
    assert clean_wiki_markup(markup) == "Bold and italic and both and l'amour and it's."


def test_unbalanced_bold_is_an_apostrophe_as_in_mediawiki() -> None:
    markup = "He uses ''A Modest Proposal'''s technique; ''Nature''{{'}}s view."
    assert clean_wiki_markup(markup) == "He uses A Modest Proposal's technique; Nature's view."


def test_headings_become_lines_and_paragraphs_are_blank_line_separated() -> None:
    markup = "Intro text.\n\n\n\n== History ==\nSome history.\n=== Early [[years]] ===\nEarly."
    assert clean_wiki_markup(markup) == (
        "Intro text.\n\nHistory\n\nSome history.\n\nEarly years\n\nEarly."
    )


def test_headings_without_prose_are_dropped() -> None:
    markup = "Intro.\n== Gallery ==\n<gallery>\nFile:a.jpg\n</gallery>\n== Life ==\nLived."
    assert clean_wiki_markup(markup) == "Intro.\n\nLife\n\nLived."


def test_reference_sections_are_cut() -> None:
    markup = (
        "Intro text.\n== History ==\nSome history.\n== See also ==\n* [[X]]\n"
        "== Notes ==\n{{reflist}}\n=== Sub note ===\nnote text\n== References ==\n* Book.\n"
        "==Further reading==\n* Book\n== External links ==\n* [http://a b]\n"
        "[[Category:Things]]"
    )
    assert clean_wiki_markup(markup) == "Intro text.\n\nHistory\n\nSome history."


def test_prose_section_after_a_cut_section_is_kept() -> None:
    markup = "Intro.\n== Notes ==\n=== Deeper ===\nnote\n== Legacy ==\nIt lasted."
    assert clean_wiki_markup(markup) == "Intro.\n\nLegacy\n\nIt lasted."


def test_list_markers_are_removed() -> None:
    markup = "Items:\n* one\n** two\n# three\n#* four\n: indented\n; term : definition"
    assert clean_wiki_markup(markup) == "Items:\none\ntwo\nthree\nfour\nindented\nterm: definition"


def test_entities_are_unescaped() -> None:
    assert clean_wiki_markup("A&nbsp;B &amp; C &lt;D&gt; caf&eacute; &#8212; x") == (
        "A B & C <D> café \u2014 x"
    )


def test_comments_are_removed() -> None:
    markup = "Keep <!-- hidden [[link]]\n{{template}} --> this.<!-- unclosed to the end"
    assert clean_wiki_markup(markup) == "Keep this."


def test_magic_words_and_letterless_lines() -> None:
    markup = "__NOTOC__\nText __TOC__ here.\n----\n12345\n* 1.\nEnd.\n   \nNext."
    assert clean_wiki_markup(markup) == "Text here.\nEnd.\n\nNext."


def test_nowiki_content_is_literal() -> None:
    assert clean_wiki_markup("Type <nowiki>''x''</nowiki> for italics.") == (
        "Type ''x'' for italics."
    )


def test_empty_parentheses_left_by_dropped_templates_are_removed() -> None:
    markup = "'''Andorra''' ({{IPAc-en|æ|n}}; {{IPA-ca|x}}), officially ({{lang-ca|Principat}})."
    assert clean_wiki_markup(markup) == "Andorra, officially (Principat)."


PATHOLOGICAL = {
    "open braces": "{{" * 50_000,
    "close braces": "}}" * 50_000,
    "open links": "[[" * 50_000,
    "unclosed links": "[[a " * 50_000,
    "unclosed refs": "<ref>" * 20_000,
    "unclosed comments": "<!--" * 20_000,
    "unclosed nowiki": "<nowiki>" * 20_000,
    "headings": "== a ==\n" * 20_000,
    "long heading-like line": "=" + "a" * 100_000,
    "unclosed external links": "[http://" * 20_000,
    "unclosed labelled external links": "[http://x y " * 20_000,
    "blank template arguments": "{{convert|" + " " * 100_000 + "}}",
    "mixed": "{{a|[[b|{{c}}]]}} [[File:x|[[y]] [[z|w]]]] <ref>q</ref> text " * 5_000,
}


@pytest.mark.parametrize("markup", PATHOLOGICAL.values(), ids=PATHOLOGICAL.keys())
def test_pathological_input_leaves_no_markup(markup: str) -> None:
    # Each of these was once quadratic in the scanner; they must finish and come out clean.
    cleaned = clean_wiki_markup(markup)
    for debris in ("{{", "}}", "[[", "]]", "<ref", "<!--"):
        assert debris not in cleaned


# ------------------------------------------------------------------------------------------
# parse_wiki_dump on a synthetic export
# ------------------------------------------------------------------------------------------


def _page(title: str, text: str, ns: int = 0, redirect: bool = False) -> str:
    redirect_tag = f'<redirect title="{title}x" />' if redirect else ""
    return (
        f"<page><title>{title}</title><ns>{ns}</ns><id>1</id>{redirect_tag}"
        f'<revision><id>2</id><text xml:space="preserve">{text}</text></revision></page>'
    )


def test_parse_synthetic_dump_filters_pages(tmp_path: Path) -> None:
    pages = [
        _page("Kept", f"'''Kept''' {PROSE}"),
        _page("Redirect element", PROSE, redirect=True),
        _page("Redirect text", f"#redirect [[Kept]] {PROSE}"),
        _page("Talk:Kept", PROSE, ns=1),
        _page("Thing (disambiguation)", PROSE),
        _page("Dab template", f"{PROSE} {{{{disambiguation}}}}"),
        _page("Short", "Too short."),
        _page("Also kept", f"{PROSE}\n== References ==\n* x"),
    ]
    xml = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">'
        + "".join(pages)
        + "</mediawiki>"
    )
    path = tmp_path / "dump.xml.bz2"
    path.write_bytes(bz2.compress(xml.encode()))
    parsed = parse_wiki_dump(path)
    assert [p.title for p in parsed] == ["Kept", "Also kept"]
    assert parsed[0].text.startswith("Kept This sentence")
    # A plain (uncompressed) export without a namespace parses the same way.
    plain = tmp_path / "dump.xml"
    plain.write_text(xml.replace(' xmlns="http://www.mediawiki.org/xml/export-0.10/"', ""))
    assert parse_wiki_dump(plain) == parsed


def test_truncated_bz2_raises_qnpu_error_naming_the_path(tmp_path: Path) -> None:
    data = wiki_dump_path().read_bytes()
    path = tmp_path / "truncated.xml.bz2"
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(QnpuError, match=re.escape(str(path))):
        parse_wiki_dump(path)


@pytest.mark.parametrize(
    "content", [b"this is not xml at all", b"BZh91AY&SYgarbage", b"<mediawiki><page>"]
)
def test_garbage_file_raises_qnpu_error_naming_the_path(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "garbage.bz2"
    path.write_bytes(content)
    with pytest.raises(QnpuError, match=re.escape(str(path))):
        parse_wiki_dump(path)


def test_missing_file_and_export_without_pages_raise(tmp_path: Path) -> None:
    with pytest.raises(QnpuError, match=r"missing\.bz2"):
        parse_wiki_dump(tmp_path / "missing.bz2")
    empty = tmp_path / "empty.xml"
    empty.write_text("<mediawiki></mediawiki>")
    with pytest.raises(QnpuError, match="no <page>"):
        parse_wiki_dump(empty)


# ------------------------------------------------------------------------------------------
# split_pages and load_wiki
# ------------------------------------------------------------------------------------------


def test_split_validates_fraction_and_non_empty_sides() -> None:
    pages = [WikiPage(f"Title {i}", PROSE) for i in range(50)]
    for bad in (0.0, 1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(QnpuError, match="eval_fraction"):
            split_pages(pages, bad)
    with pytest.raises(QnpuError, match="empty"):
        split_pages(pages[:1], 0.5)
    with pytest.raises(QnpuError, match="empty"):
        split_pages([], 0.5)


def test_unknown_split_raises_listing_valid_ones() -> None:
    with pytest.raises(QnpuError, match="calib, eval, all"):
        load_wiki("train")


def test_missing_gensim_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(QnpuError, match="pip install --no-deps gensim"):
        wiki_dump_path()


# ------------------------------------------------------------------------------------------
# The real dump
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_pages() -> list[WikiPage]:
    return parse_wiki_dump(wiki_dump_path())


def test_real_dump_has_enough_pages(real_pages: list[WikiPage]) -> None:
    assert len(real_pages) >= 50
    assert len({p.title for p in real_pages}) == len(real_pages)
    assert all(len(p.text) >= 200 for p in real_pages)


def test_real_split_is_disjoint_complete_and_deterministic(real_pages: list[WikiPage]) -> None:
    splits = split_pages(real_pages)
    calib = [p.title for p in splits["calib"]]
    evals = [p.title for p in splits["eval"]]
    assert calib and evals
    assert not set(calib) & set(evals)
    assert sorted(calib + evals) == sorted(p.title for p in real_pages)
    assert 0.1 <= len(evals) / len(real_pages) <= 0.3
    # Order within each side follows the file.
    order = {p.title: i for i, p in enumerate(real_pages)}
    assert calib == sorted(calib, key=order.__getitem__)
    again = split_pages(real_pages)
    assert [p.title for p in again["eval"]] == evals


def test_real_texts_have_no_markup_left(real_pages: list[WikiPage]) -> None:
    for page in real_pages:
        for token in ("{{", "}}", "[[", "]]", "<ref", "{|", "'''", "__TOC__", "thumb|"):
            assert token not in page.text, (page.title, token)
        assert "\n\n\n" not in page.text
        assert page.text == page.text.strip()


def test_real_anarchism_page(real_pages: list[WikiPage]) -> None:
    by_title = {p.title: p for p in real_pages}
    assert "Anarchism" in by_title  # the gensim dump's first article
    text = by_title["Anarchism"].text
    assert "anarchism" in text.lower()
    assert text.startswith("Anarchism is a political philosophy")
    assert "\nReferences\n" not in text


def test_load_wiki_returns_split_texts(real_pages: list[WikiPage]) -> None:
    # One call only: load_wiki reparses the dump every time.
    assert load_wiki("eval") == [p.text for p in split_pages(real_pages)["eval"]]
