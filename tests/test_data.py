import json

import jax
import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.data import eval_windows, load_documents, sample_windows, tokenize_documents
from qnpu_jax.data.sources import wikitext_rows


def test_eval_windows_drop_remainder_and_cap():
    ids = np.arange(10, dtype=np.int32)
    np.testing.assert_array_equal(eval_windows(ids, 4), [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert eval_windows(ids, 3, max_windows=2).shape == (2, 3)
    with pytest.raises(QnpuError, match="fewer than one window"):
        eval_windows(ids, 11)
    with pytest.raises(QnpuError, match="seq_len must be at least 2"):
        eval_windows(ids, 1)


def test_sample_windows_are_seeded_slices():
    ids = np.arange(1000, dtype=np.int32)
    a = sample_windows(ids, 16, 8, jax.random.key(7))
    b = sample_windows(ids, 16, 8, jax.random.key(7))
    c = sample_windows(ids, 16, 8, jax.random.key(8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.shape == (8, 16)
    np.testing.assert_array_equal(a - a[:, :1], np.broadcast_to(np.arange(16), (8, 16)))


def test_plain_file_is_one_document(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("first line\n\nsecond paragraph\n")
    assert load_documents(str(path)) == ["first line\n\nsecond paragraph\n"]


def test_wikitext_rows_follow_hf_convention(wikitext_test_path):
    rows = load_documents(f"wikitext:{wikitext_test_path}")
    assert len(rows) == 4358  # the HF wikitext-2-raw-v1 test split has 4,358 rows
    assert rows[0] == "" and rows[1] == " = Robert Boulter = \n"
    assert wikitext_rows(" a \n \nb") == [" a \n", "", "b"]


def test_hf_dataset_from_local_folder(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    rows = [{"text": "alpha beta"}, {"text": "gamma"}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_documents(f"hf:{folder}:train") == ["alpha beta", "gamma"]
    with pytest.raises(QnpuError, match="cannot load dataset"):
        load_documents(f"hf:{folder}:validation")


def test_bad_data_specs(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n ")
    with pytest.raises(QnpuError, match="holds no text"):
        load_documents(str(empty))
    with pytest.raises(QnpuError, match="unknown data"):
        load_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(QnpuError, match="does not exist"):
        load_documents(f"wikitext:{tmp_path / 'missing.raw'}")
    with pytest.raises(QnpuError, match="unknown Wikipedia split 'test'"):
        load_documents("wiki", "test")
    with pytest.raises(QnpuError, match="--split applies to the 'wiki' corpus only"):
        load_documents(str(empty), "eval")
    with pytest.raises(QnpuError, match="expected hf:NAME"):
        load_documents("hf:onlyname")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(QnpuError, match="cannot read data file"):
        load_documents(str(binary))


def test_documents_joined_with_blank_line_without_bos(smollm):
    ids = tokenize_documents(["Hello world", "Second"], smollm.tokenizer)
    assert list(ids) == smollm.tokenizer.encode("Hello world\n\nSecond")
    assert ids[0] != smollm.tokenizer.bos_token_id


def test_the_data_cache_returns_what_deriving_returns_and_rederives_a_bad_entry(
    smollm, tmp_path, monkeypatch
):
    """The parsed dump and the token ids come back from the cache equal to what parsing and
    tokenizing give with the cache off; a second reader derives nothing; an entry whose bytes
    do not match its digest is derived again; a key covers each of its parts."""
    import qnpu_jax.data.sources as sources
    import qnpu_jax.data.wiki as wiki
    from qnpu_jax.data.cache import CACHE_DIR_ENV, cached_bytes, digest

    monkeypatch.setenv(CACHE_DIR_ENV, "")
    docs_off = load_documents("wiki", "eval")
    ids_off = tokenize_documents(docs_off, smollm.tokenizer)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    docs, ids = load_documents("wiki", "eval"), tokenize_documents(docs_off, smollm.tokenizer)
    assert docs == docs_off
    np.testing.assert_array_equal(ids, ids_off)
    assert ids.dtype == np.int32
    entries = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert entries == ["tokens", "wiki"], entries

    def refuse(*_args, **_kwargs):
        raise AssertionError("derived again")

    with monkeypatch.context() as m:
        m.setattr(wiki, "parse_wiki_dump", refuse)
        m.setattr(type(smollm.tokenizer), "encode", refuse)
        assert load_documents("wiki", "eval") == docs_off
        np.testing.assert_array_equal(tokenize_documents(docs_off, smollm.tokenizer), ids_off)
    # a torn or edited entry: derived again and replaced
    (entry,) = tmp_path.glob("tokens-*")
    raw = bytearray(entry.read_bytes())
    raw[-1] ^= 1
    entry.write_bytes(bytes(raw))
    np.testing.assert_array_equal(tokenize_documents(docs_off, smollm.tokenizer), ids_off)
    assert entry.read_bytes() != bytes(raw)
    # the key covers every part, length-prefixed
    assert digest("ab", "c") != digest("a", "bc")
    calls = []
    assert cached_bytes("t", digest("x"), lambda: calls.append(1) or b"v") == b"v"
    assert cached_bytes("t", digest("x"), lambda: calls.append(1) or b"w") == b"v"
    assert cached_bytes("t", digest("y"), lambda: calls.append(1) or b"w") == b"w"
    assert len(calls) == 2
    assert sources.cached_bytes is cached_bytes
