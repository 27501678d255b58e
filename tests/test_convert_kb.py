"""KB converters and the article store: the E-VQA KB format (JSON streamed, and the JSONL variant), Wiki6M (a real
row from tests/data/realdata, real rows copied into the repository), title-keyed image CSVs, the QID → URL map, the KB
check, and the toy world's KB going
through the store unchanged."""

import csv
import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.files import json_record, read_jsonl
from retrieval.upstream.articles import ArticleStore, store_from_kb_rows, store_path_for
from retrieval.upstream.convert import ConvertArgs, convert
from retrieval.upstream.kb import (
    canonical_url,
    evqa_article,
    image_resolver,
    iter_evqa_kb,
    qid_map_from_wiki6m,
    read_entity_map,
    read_upstream_jsonl,
    remap_entity,
    title_images,
    url_hash,
    wiki6m_article,
    wiki6m_image_finder,
    wiki6m_url,
)
from tests.upstream_site import serve_in_background

REAL = Path(__file__).resolve().parent / "data" / "realdata"  # real rows, their sources in SOURCES.md
ZORVAK = "https://en.wikipedia.org/wiki/Zorvak"
PARIS = "https://en.wikipedia.org/wiki/Paris"
EVQA_KB = {
    ZORVAK: {
        "title": "Zorvak",
        "url": ZORVAK,
        "section_titles": ["Zorvak", "Habitat", "Diet", "References"],
        "section_texts": ["The Zorvak is a red star.", "It lives in caves.", "", "Smith 2001."],
        "image_urls": [
            "http://img/a.jpg",
            "http://img/b.jpg",
            "http://img/c.jpg",
            "http://img/d.jpg",
            "http://img/dead.jpg",
        ],
        "image_reference_descriptions": ["", "", "", "", ""],
        "image_section_indices": [1, None, 2, 7],  # d.jpg: out of range; dead.jpg: no index at all
    },
    "https://en.wikipedia.org/wiki/No_picture": {  # an article with sections but no image still matters
        "title": "No picture",
        "url": "https://en.wikipedia.org/wiki/No_picture",
        "section_titles": ["No picture", "History"],
        "section_texts": ["A place.", "Built in 1900."],
        "image_urls": [],
        "image_reference_descriptions": [],
        "image_section_indices": [],
    },
}


def quiet(*a):
    pass


def image_folder(tmp_path, urls):
    folder = tmp_path / "kb_images"
    folder.mkdir(exist_ok=True)
    for u in urls:
        (folder / f"{url_hash(u)}.jpg").write_bytes(b"x")
    return folder


@pytest.mark.parametrize("variant", ["json", "jsonl"])
def test_evqa_kb_rows_and_every_section_in_the_store(tmp_path, variant):
    folder = image_folder(tmp_path, ["http://img/a.jpg", "http://img/b.jpg", "http://img/c.jpg", "http://img/d.jpg"])
    if variant == "json":
        (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    else:  # mKG-RAG's variant: one {url: article} a line
        (tmp_path / "kb.jsonl").write_text("".join(json.dumps({k: v}) + "\n" for k, v in EVQA_KB.items()))
    n = convert(
        ConvertArgs(
            format="evqa-kb",
            input=str(tmp_path / f"kb.{variant}"),
            image_dir=str(folder),
            out=str(tmp_path / "out" / "kb.jsonl"),
        ),
        log=quiet,
    )
    rows = list(read_jsonl(tmp_path / "out" / "kb.jsonl"))
    by_image = {r["image"]: r for r in rows}
    a = f"{url_hash('http://img/a.jpg')}.jpg"
    assert n == 4 and by_image[a]["section_title"] == "Habitat" and by_image[a]["section"] == 1
    for u in "bcd":  # missing index, empty section, out of range → the first section
        r = by_image[f"{url_hash(f'http://img/{u}.jpg')}.jpg"]
        assert (r["section"], r["section_title"], r["text"]) == (0, "Zorvak", "The Zorvak is a red star.")
    skipped = list(read_jsonl(tmp_path / "out" / "kb.jsonl.skipped.jsonl"))
    assert skipped == [{"entry_id": f"{ZORVAK}#image4", "reason": "no local file for image http://img/dead.jpg"}]
    store = ArticleStore(store_path_for(tmp_path / "out" / "kb.jsonl"))
    assert len(store) == 2 and store.counts() == {"articles": 2, "sections": 6, "entries": 4}
    assert [s["section_title"] for s in store.sections(ZORVAK)] == ["Zorvak", "Habitat", "Diet", "References"]
    assert [s["section_title"] for s in store.sections(ZORVAK, skip_titles=["references"])] == [
        "Zorvak",
        "Habitat",
        "Diet",
    ]
    assert [s["text"] for s in store.sections("https://en.wikipedia.org/wiki/No_picture")] == [
        "A place.",
        "Built in 1900.",
    ]
    for r in rows:  # every index row is reachable by its entry id, with the same text
        e = store.entry(r["entry_id"])
        assert {k: e[k] for k in r} == r
    assert store.entry("nope") is None and store.article("nope") is None and "nope" not in store and ZORVAK in store


def test_evqa_kb_with_title_keyed_image_csvs(tmp_path):
    root = tmp_path / "wiki_images"
    for rel in ("split1/zorvak_0.jpg", "split1/zorvak_1.jpg"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    with open(tmp_path / "wiki_image_url_part_1.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["title", "url", "path", "caption"])
        w.writerow(["Zorvak", "u0", "split1/zorvak_0.jpg", "a star"])
        w.writerow(["Zorvak", "u0", "split1/zorvak_0.jpg", "again"])  # duplicate path: once
        w.writerow(["Zorvak", "u1", "split1/zorvak_1.jpg", ""])
        w.writerow(["Zorvak", "u2", "split1/not_downloaded.jpg", ""])  # no file: left out, as their loaders do
    (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    n = convert(
        ConvertArgs(
            format="evqa-kb",
            input=str(tmp_path / "kb.json"),
            images_root=str(root),
            image_csv=str(tmp_path / "wiki_image_url_part_*.csv"),
            out=str(tmp_path / "kb.jsonl"),
        ),
        log=quiet,
    )
    rows = list(read_jsonl(tmp_path / "kb.jsonl"))
    assert n == 2 and [r["image"] for r in rows] == ["split1/zorvak_0.jpg", "split1/zorvak_1.jpg"]
    assert all(r["section"] == 0 and r["entity_id"] == ZORVAK for r in rows)
    assert {(r["section_title"], r["text"]) for r in rows} == {("Zorvak", "The Zorvak is a red star.")}


def test_evqa_kb_images_through_an_image_map(tmp_path):
    (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    (tmp_path / "url2path.json").write_text(json.dumps({"http://img/a.jpg": "w/a.jpg", "http://img/c.jpg": "w/c.jpg"}))
    args = dict(format="evqa-kb", input=str(tmp_path / "kb.json"), out=str(tmp_path / "kb.jsonl"))
    store = tmp_path / "elsewhere" / "store.sqlite"
    n = convert(ConvertArgs(**args, image_map=str(tmp_path / "url2path.json"), articles=str(store)), log=quiet)
    rows = [(r["entry_id"], r["image"], r["section"]) for r in read_jsonl(tmp_path / "kb.jsonl")]
    assert n == 2 and rows == [(f"{ZORVAK}#image0", "w/a.jpg", 1), (f"{ZORVAK}#image2", "w/c.jpg", 0)]
    assert ArticleStore(store).counts()["entries"] == 2 and not store_path_for(tmp_path / "kb.jsonl").exists()
    skipped = [s["entry_id"] for s in read_jsonl(tmp_path / "kb.jsonl.skipped.jsonl")]
    assert skipped == [f"{ZORVAK}#image{j}" for j in (1, 3, 4)]
    (tmp_path / "list.json").write_text('["w/a.jpg"]')
    with pytest.raises(ValueError, match="--image_map: .*list.json is not a JSON object"):
        convert(ConvertArgs(**args, image_map=str(tmp_path / "list.json")), log=quiet)


def test_evqa_kb_needs_exactly_one_image_source(tmp_path):
    (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    with pytest.raises(ValueError, match="exactly one of --image_map, --image_dir, --image_csv"):
        convert(ConvertArgs(format="evqa-kb", input=str(tmp_path / "kb.json"), out=str(tmp_path / "kb.jsonl")))
    with pytest.raises(ValueError, match="--image_csv: no file matches .*wiki_image_url_part_"):
        convert(
            ConvertArgs(
                format="evqa-kb",
                input=str(tmp_path / "kb.json"),
                image_csv=str(tmp_path / "wiki_image_url_part_*.csv"),
                images_root=str(tmp_path),
                out=str(tmp_path / "kb.jsonl"),
            )
        )
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object keyed by Wikipedia URL"):
        convert(
            ConvertArgs(
                format="evqa-kb",
                input=str(tmp_path / "list.json"),
                image_dir=str(tmp_path),
                out=str(tmp_path / "kb.jsonl"),
            )
        )
    assert not (tmp_path / "kb.jsonl").exists() and not store_path_for(tmp_path / "kb.jsonl").exists()


def wiki6m_rows():
    real = list(read_jsonl(REAL / "wiki6m_sample.jsonl"))  # wikipedia_image_url is null there
    return real + [
        {
            "wikidata_id": "Q243",
            "wikipedia_title": "Eiffel Tower",
            "wikipedia_summary": "A tower in Paris.",
            "wikipedia_content": "A tower in Paris. It was built in 1889.",
            "wikipedia_image_url": "http://img/eiffel.jpg",
        },
        {
            "wikidata_id": "Q90",
            "wikipedia_title": "Paris",
            "wikipedia_summary": "Capital of France.",
            "wikipedia_content": "Capital of France. Big.",
            "wikipedia_image_url": None,
        },
    ]


def write_wiki6m(tmp_path, rows=None):
    rows = wiki6m_rows() if rows is None else rows
    (tmp_path / "Wiki6M_ver_1_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    root = tmp_path / "wikipedia_images_full"
    (root / "Q90").mkdir(parents=True)
    (root / "Q90" / "Q90.jpg").write_bytes(b"x")  # UniIR's <QID[:4]>/<QID>.jpg layout
    folder = image_folder(tmp_path, ["http://img/eiffel.jpg"])
    return root, folder


def convert_wiki6m(tmp_path, root, folder) -> int:
    """``write_wiki6m``'s file converted to ``tmp_path/kb.jsonl`` with its images."""
    return convert(
        ConvertArgs(
            format="wiki6m",
            input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"),
            images_root=str(root),
            image_dir=str(folder),
            out=str(tmp_path / "kb.jsonl"),
        ),
        log=quiet,
    )


def test_wiki6m_kb_keys_entities_by_qid(tmp_path):
    root, folder = write_wiki6m(tmp_path)
    n = convert_wiki6m(tmp_path, root, folder)
    rows = {r["entity_id"]: r for r in read_jsonl(tmp_path / "kb.jsonl")}
    assert n == 2 and set(rows) == {"Q243", "Q90"}
    assert rows["Q90"]["image"] == "Q90/Q90.jpg" and rows["Q243"]["image"] == f"{url_hash('http://img/eiffel.jpg')}.jpg"
    assert rows["Q243"]["text"] == "A tower in Paris." and rows["Q243"]["title"] == "Eiffel Tower"
    (skip,) = read_jsonl(tmp_path / "kb.jsonl.skipped.jsonl")  # the real row: no image url, no file
    assert skip["entry_id"] == "Q3783438#image0" and "no image url" in skip["reason"]
    store = ArticleStore(store_path_for(tmp_path / "kb.jsonl"))
    assert "Q3783438" in store and store.article("Q3783438")["title"] == "Harold Keeling"  # kept without an image
    assert [s["section_title"] for s in store.sections("Q243")] == ["Eiffel Tower", "content"]
    assert store.article("Q243")["url"] == "https://en.wikipedia.org/wiki/Eiffel_Tower"


def infoseek_question_files(tmp_path):
    rows = [
        {
            "data_id": "infoseek_val_00000001",
            "image_id": "oven_05050169",
            "question": "Which city is this in?",
            "answer": ["Paris"],
            "answer_eval": ["Paris"],
            "data_split": "val_unseen_entity",
        },
        {
            "data_id": "infoseek_val_00000002",
            "image_id": "oven_05050170",
            "question": "Built when?",
            "answer": ["1889"],
            "answer_eval": [{"wikidata": 1889.0, "range": [1888.0, 1890.0]}],
            "data_split": "val_unseen_question",
        },
        {
            "data_id": "infoseek_val_00000003",
            "image_id": "oven_05050171",
            "question": "Who?",
            "answer": ["x"],
            "answer_eval": ["x"],
            "data_split": "val_unseen_question",
        },
    ]
    withkb = [
        {"data_id": "infoseek_val_00000002", "entity_id": "Q243", "entity_text": "Eiffel Tower"},
        {"data_id": "infoseek_val_00000001", "entity_id": "Q90", "entity_text": "Paris"},  # another order
        {"data_id": "infoseek_val_00000003", "entity_id": "Q3", "entity_text": "Not in any KB"},
    ]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val_withkb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in withkb))


def test_infoseek_questions_meet_a_wiki6m_kb_and_a_url_kb_through_the_qid_map(tmp_path):
    root, folder = write_wiki6m(tmp_path)
    infoseek_question_files(tmp_path)
    convert(
        ConvertArgs(
            format="wiki6m",
            input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"),
            images_root=str(root),
            image_dir=str(folder),
            out=str(tmp_path / "wiki6m_kb.jsonl"),
        ),
        log=quiet,
    )
    q = dict(format="infoseek", input=str(tmp_path / "val.jsonl"), withkb=str(tmp_path / "val_withkb.jsonl"))
    # 1. QID questions against the QID-keyed Wiki6M KB: gold entities resolve directly
    convert(ConvertArgs(**q, kb=str(tmp_path / "wiki6m_kb.jsonl"), out=str(tmp_path / "q_qid.jsonl")), log=quiet)
    assert [a["entity_id"] for a in read_jsonl(tmp_path / "q_qid.jsonl.absent.jsonl")] == [["Q3"]]
    # 2. against a URL-keyed KB (EchoSight's format, spelled http:// and with %-escapes) through a QID → URL map
    url_kb = {
        "http://en.wikipedia.org/wiki/Eiffel%20Tower": {
            **EVQA_KB[ZORVAK],
            "url": "http://en.wikipedia.org/wiki/Eiffel%20Tower",
            "title": "Eiffel Tower",
        },
        "https://en.wikipedia.org/wiki/Paris": {
            **EVQA_KB[ZORVAK],
            "url": "https://en.wikipedia.org/wiki/Paris",
            "title": "Paris",
        },
    }
    (tmp_path / "url_kb.json").write_text(json.dumps(url_kb))
    folder2 = image_folder(tmp_path, ["http://img/a.jpg"])
    convert(
        ConvertArgs(
            format="evqa-kb",
            input=str(tmp_path / "url_kb.json"),
            image_dir=str(folder2),
            out=str(tmp_path / "url_kb.jsonl"),
        ),
        log=quiet,
    )
    convert(
        ConvertArgs(format="qid-map", input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"), out=str(tmp_path / "qid2url.tsv")),
        log=quiet,
    )
    for kb in ("url_kb.jsonl", "url_kb.articles.sqlite"):  # the KB JSONL or its article store
        out = tmp_path / f"q_url_{kb}.jsonl"
        convert(
            ConvertArgs(**q, entity_map=str(tmp_path / "qid2url.tsv"), kb=str(tmp_path / kb), out=str(out)), log=quiet
        )
        got = {r["id"]: r["entity_id"] for r in read_jsonl(out)}
        assert got == {
            "infoseek_val_00000001": "https://en.wikipedia.org/wiki/Paris",
            "infoseek_val_00000002": "http://en.wikipedia.org/wiki/Eiffel%20Tower",  # the KB's own key
            "infoseek_val_00000003": "Q3",
        }  # unmapped: unchanged, and reported absent
        assert [a["id"] for a in read_jsonl(f"{out}.absent.jsonl")] == ["infoseek_val_00000003"]


def test_kb_check_reports_nothing_when_every_gold_entity_is_there(tmp_path, capsys):
    root, folder = write_wiki6m(tmp_path)
    infoseek_question_files(tmp_path)
    convert(
        ConvertArgs(
            format="wiki6m",
            input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"),
            images_root=str(root),
            image_dir=str(folder),
            out=str(tmp_path / "kb.jsonl"),
        ),
        log=quiet,
    )
    (tmp_path / "q.jsonl.absent.jsonl").write_text('{"id": "x", "entity_id": ["Q3"]}\n')  # an earlier run's
    rows = [r for r in read_jsonl(tmp_path / "val.jsonl") if r["data_id"] != "infoseek_val_00000003"]
    rows.append({**rows[0], "data_id": "infoseek_val_00000009"})  # no withkb row: no gold entity to miss
    (tmp_path / "val2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    convert(
        ConvertArgs(
            format="infoseek",
            input=str(tmp_path / "val2.jsonl"),
            withkb=str(tmp_path / "val_withkb.jsonl"),
            require_entity=False,
            kb=str(tmp_path / "kb.jsonl"),
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    assert "0 of 3 questions have a gold entity the KB has no row for" in capsys.readouterr().out
    assert not (tmp_path / "q.jsonl.absent.jsonl").exists()


def test_toy_kb_goes_through_the_store_unchanged(tmp_path, tiny_world):
    toy_world = tiny_world
    kb = list(read_jsonl(toy_world / "kb.jsonl"))
    n = convert(
        ConvertArgs(format="articles", input=str(toy_world / "kb.jsonl"), out=str(tmp_path / "a.sqlite")), log=quiet
    )
    store = ArticleStore(tmp_path / "a.sqlite")
    assert n == len(kb) and len(store) == len({r["entity_id"] for r in kb})
    for r in kb:
        e = store.entry(r["entry_id"])
        assert {k: e[k] for k in r} == r
    some = kb[0]["entity_id"]
    texts = {r["text"] for r in kb if r["entity_id"] == some}
    assert {s["text"] for s in store.sections(some)} == texts and len(store.sections(some)) == len(texts)
    assert store_path_for(toy_world / "kb.jsonl").is_file()  # the toy world writes its store itself


def test_store_keeps_each_entrys_own_section_index(tmp_path):
    """Entries that carry their section index keep it, even two sections of equal text (4 and 7), and an entry
    without one is numbered with the first index not taken (it collided with an explicit 1 and the store refused a
    key the KB never repeated)."""
    rows = [
        dict(entry_id="a", entity_id="E", title="E", section_title="s", text="same", image="a.png", section=4),
        dict(entry_id="b", entity_id="E", title="E", section_title="s", text="same", image="b.png", section=7),
        dict(entry_id="c", entity_id="F", title="F", section_title="lead", text="x", image="c.png", section=1),
        dict(entry_id="d", entity_id="F", title="F", section_title="more", text="y", image="d.png"),
    ]
    assert store_from_kb_rows(rows, tmp_path / "a.sqlite") == {"articles": 2, "sections": 4, "entries": 4}
    store = ArticleStore(tmp_path / "a.sqlite")
    assert [store.entry(i)["section"] for i in "abcd"] == [4, 7, 1, 0]
    assert store.entry("d")["text"] == "y" and store.entry("c")["text"] == "x"


def test_a_null_title_or_text_is_stored_empty(tmp_path):
    """An upstream null (a section title, a text, an article title) is stored as "", so the title filter and the
    entries' text read it as any other section."""
    from retrieval.upstream.articles import ArticleWriter

    with ArticleWriter(tmp_path / "a.sqlite") as w:
        w.add_article("E", None, None, [(0, None, None), (1, "References", "Smith.")])
        w.add_entry("E#image0", "E", 0, "a.jpg")
    store = ArticleStore(tmp_path / "a.sqlite")
    assert [(s["section_title"], s["text"]) for s in store.sections("E", skip_titles=["references"])] == [("", "")]
    assert store.entry("E#image0")["title"] == "" and store.article("E")["title"] == ""


def test_a_kb_without_its_store_gets_one_built_beside_it_unless_one_is_named(tmp_path):
    from retrieval.upstream.articles import open_store

    rows = [dict(entry_id="a", entity_id="E", title="E", section_title="s", text="t", image="a.png", section=0)]
    (tmp_path / "kb.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="--articles: .*elsewhere.sqlite does not exist"):
        open_store(tmp_path / "kb.jsonl", tmp_path / "elsewhere.sqlite", log=quiet)
    said = []
    store = open_store(tmp_path / "kb.jsonl", log=said.append)
    assert store.path == store_path_for(tmp_path / "kb.jsonl") and store.entry("a") == rows[0]
    assert "built from" in said[0] and "1 articles, 1 sections" in said[0]
    said.clear()
    open_store(tmp_path / "kb.jsonl", log=said.append)
    assert said == []  # there now: opened, not built again


def test_store_refuses_interleaved_entities_and_leaves_nothing(tmp_path):
    rows = [
        dict(entry_id=f"e{i}", entity_id=ent, title=ent, section_title="s", text="t", image="x.png")
        for i, ent in enumerate(["A", "B", "A"])
    ]
    with pytest.raises(ValueError, match="not contiguous"):
        store_from_kb_rows(rows, tmp_path / "a.sqlite")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="does not exist"):
        ArticleStore(tmp_path / "a.sqlite")


@given(st.text(alphabet="abcdefghij _()", min_size=1, max_size=20))
def test_canonical_url_ignores_scheme_escapes_and_spaces(title):
    import urllib.parse

    url = wiki6m_url(title)
    variants = [
        url,
        url.replace("https://", "http://"),
        "http://en.wikipedia.org/wiki/" + urllib.parse.quote(title),
        url.replace("en.wikipedia", "en.m.wikipedia"),
    ]
    assert len({canonical_url(v) for v in variants}) == 1


def test_qid_map_from_echosight_csv_joined_with_withkb(tmp_path):
    with open(tmp_path / "infoseek_test.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["data_id", "wikipedia_url", "question_type"])
        w.writeheader()
        w.writerow(
            {
                "data_id": "infoseek_val_1",
                "wikipedia_url": "https://en.wikipedia.org/wiki/Paris",
                "question_type": "infoseek",
            }
        )
        w.writerow(
            {
                "data_id": "infoseek_val_2",
                "wikipedia_url": "https://en.wikipedia.org/wiki/Paris",
                "question_type": "infoseek",
            }
        )  # same entity again: once
        w.writerow(
            {
                "data_id": "infoseek_val_9",
                "wikipedia_url": "https://en.wikipedia.org/wiki/Nowhere",
                "question_type": "infoseek",
            }
        )  # no withkb row: no pair
        w.writerow({"data_id": "infoseek_val_3", "wikipedia_url": "", "question_type": "infoseek"})  # no URL: no pair
    (tmp_path / "withkb.jsonl").write_text(
        '{"data_id": "infoseek_val_2", "entity_id": "Q90", "entity_text": "Paris"}\n'
        '{"data_id": "infoseek_val_1", "entity_id": "Q90", "entity_text": "Paris"}\n'
        '{"data_id": "infoseek_val_3", "entity_id": "Q5", "entity_text": "Human"}\n'
    )
    n = convert(
        ConvertArgs(
            format="qid-map",
            input=str(tmp_path / "infoseek_test.csv"),
            withkb=str(tmp_path / "withkb.jsonl"),
            out=str(tmp_path / "m.tsv"),
        ),
        log=quiet,
    )
    assert n == 1 and (tmp_path / "m.tsv").read_text() == "Q90\thttps://en.wikipedia.org/wiki/Paris\n"
    with pytest.raises(ValueError, match="--withkb"):
        convert(ConvertArgs(format="qid-map", input=str(tmp_path / "infoseek_test.csv"), out=str(tmp_path / "x.tsv")))


def test_fetch_images_names_files_by_url_hash_resumes_and_lists_failures(tmp_path):
    import functools
    import http.server

    from retrieval.upstream.fetch_images import FetchArgs, fetch_images, file_name

    site = tmp_path / "site"
    site.mkdir()
    (site / "a.jpg").write_bytes(b"\xff\xd8 jpeg bytes")
    (site / "b.png").write_bytes(b"\x89PNG bytes")
    (site / "page.html").write_text("<html></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = serve_in_background(http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler))
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        urls = [f"{base}/a.jpg", f"{base}/b.png", f"{base}/gone.jpg", f"{base}/page.html"]
        kb = {ZORVAK: {**EVQA_KB[ZORVAK], "image_urls": urls + [f"{base}/a.jpg"]}}  # a repeated URL: once
        (tmp_path / "kb.json").write_text(json.dumps(kb))
        args = FetchArgs(kb=str(tmp_path / "kb.json"), out=str(tmp_path / "imgs"), workers=2, timeout=5, user_agent=UA)
        first = fetch_images(args, log=quiet)
        assert first == {"fetched": 2, "failed": 2, "already there": 0, "failed before": 0}
        assert (tmp_path / "imgs" / file_name(urls[0])).read_bytes() == b"\xff\xd8 jpeg bytes"
        assert file_name(urls[1]) == f"{url_hash(urls[1])}.png"
        failed = {r["url"]: r["reason"] for r in read_jsonl(tmp_path / "imgs" / "failed.jsonl")}
        assert set(failed) == {urls[2], urls[3]} and "404" in failed[urls[2]] and "text/html" in failed[urls[3]]
        resumed = fetch_images(
            args, log=quiet
        )  # nothing new: the two fetched are there, the two failures for good listed
        assert resumed == {"fetched": 0, "failed": 0, "already there": 2, "failed before": 2}
        # the folder is what the KB converter's --image_dir reads
        n = convert(
            ConvertArgs(
                format="evqa-kb",
                input=str(tmp_path / "kb.json"),
                image_dir=str(tmp_path / "imgs"),
                out=str(tmp_path / "kb.jsonl"),
            ),
            log=quiet,
        )
        assert n == 3  # a.jpg twice (two image slots) and b.png
    finally:
        server.shutdown()


# --------------------------------------------------------------------------- upstream issues: one table each


def kb_with_images(tmp_path, urls, name="kb.json"):
    kb = {
        ZORVAK: {
            **EVQA_KB[ZORVAK],
            "image_urls": urls,
            "image_section_indices": [0] * len(urls),
            "image_reference_descriptions": [""] * len(urls),
        }
    }
    (tmp_path / name).write_text(json.dumps(kb))
    return tmp_path / name


UA = "Test Runner (tests@example.org)"
WIKI_SVG = "/wikipedia/commons/a/ab/Flag_of_Zorvak.svg"
WIKI_THUMB = "/wikipedia/commons/thumb/a/ab/Flag_of_Zorvak.svg/960px-Flag_of_Zorvak.svg.png"


@pytest.mark.parametrize(
    "case",
    [
        # SVG on Wikimedia's upload layout: its PNG rendering is fetched (Wikimedia serves
        # /thumb/…/<w>px-<name>.svg.png)
        dict(name="wikimedia svg", path=WIKI_SVG, rasteriser=False, old_svg=False, fetched=1, row=".png"),
        # an SVG elsewhere with no rasteriser installed: listed as failed with the reason, no file a build would drop
        dict(
            name="svg elsewhere, no rasteriser",
            path="/static/logo.svg",
            rasteriser=False,
            old_svg=False,
            fetched=0,
            row=None,
            failed="SVG",
        ),
        # an SVG elsewhere with a rasteriser (cairosvg when installed; a stand-in here): a PNG is written
        dict(
            name="svg elsewhere, rasteriser",
            path="/static/logo.svg",
            rasteriser=True,
            old_svg=False,
            fetched=1,
            row=".png",
        ),
        # an .svg left by an earlier run: the converter lists its row as skipped; fetching again replaces it by the PNG
        dict(name="svg left by an older run", path=WIKI_SVG, rasteriser=False, old_svg=True, fetched=1, row=".png"),
    ],
    ids=lambda c: c["name"],
)
def test_svg_kb_images_become_png_or_are_listed(tmp_path, monkeypatch, case):
    import retrieval.upstream.fetch_images as fi
    from tests.upstream_site import SVG, Site, ok, png_bytes

    routes = {
        WIKI_THUMB: [ok(png_bytes())],
        WIKI_SVG: [ok(SVG, "image/svg+xml")],
        "/static/logo.svg": [ok(SVG, "image/svg+xml")],
    }
    monkeypatch.setattr(
        fi, "svg_rasteriser", (lambda: lambda data, width: png_bytes()) if case["rasteriser"] else (lambda: None)
    )
    with Site(routes) as site:
        url = site.url(case["path"])
        kb = kb_with_images(tmp_path, [url])
        imgs = tmp_path / "imgs"
        if case["old_svg"]:
            imgs.mkdir()
            (imgs / f"{url_hash(url)}.svg").write_bytes(SVG)
            convert(
                ConvertArgs(format="evqa-kb", input=str(kb), image_dir=str(imgs), out=str(tmp_path / "old.jsonl")),
                log=quiet,
            )
            (skip,) = read_jsonl(tmp_path / "old.jsonl.skipped.jsonl")
            assert "SVG" in skip["reason"] and not list(read_jsonl(tmp_path / "old.jsonl"))
        counts = fi.fetch_images(
            fi.FetchArgs(kb=str(kb), out=str(imgs), workers=1, timeout=5, user_agent=UA), log=quiet
        )
        assert counts["fetched"] == case["fetched"]
        if case["path"] == WIKI_SVG:
            assert site.paths() == [WIKI_THUMB]  # the rendering, never the SVG itself
    n = convert(
        ConvertArgs(format="evqa-kb", input=str(kb), image_dir=str(imgs), out=str(tmp_path / "kb.jsonl")), log=quiet
    )
    rows = list(read_jsonl(tmp_path / "kb.jsonl"))
    if case["row"]:
        assert n == 1 and rows[0]["image"] == f"{url_hash(url)}{case['row']}"
        from retrieval.kb import load_image

        assert load_image(imgs / rows[0]["image"])[1] is None  # what the build decodes
    else:
        assert n == 0
        (failed,) = read_jsonl(imgs / "failed.jsonl")
        assert case["failed"] in failed["reason"] and "cairosvg" in failed["reason"]
    if case["old_svg"]:
        assert (imgs / f"{url_hash(url)}.svg").exists()  # nothing already there is lost


def pack(path: Path, packing: str) -> Path:
    """The file as the downloads pack it: as it is, gzipped (.gz) or inside a .zip; ``mac zip``: as a Mac packs a
    folder (folder entries, and an AppleDouble ``._`` file beside the data file and under ``__MACOSX/``)."""
    import gzip
    import zipfile

    if packing == "plain":
        return path
    if packing == "gz":
        out = path.with_name(path.name + ".gz")
        out.write_bytes(gzip.compress(path.read_bytes()))
    else:
        out = path.with_name(path.stem + ".zip")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            if packing == "mac zip":
                for folder in ("some_folder/", "__MACOSX/", "__MACOSX/some_folder/"):
                    z.writestr(folder, "")
                z.writestr(f"__MACOSX/some_folder/._{path.name}", b"\x00\x05\x16\x07")
                z.writestr(f"some_folder/._{path.name}", b"\x00\x05\x16\x07")
            z.write(path, f"some_folder/{path.name}")
    path.unlink()
    return out


@pytest.mark.parametrize("packing", ["plain", "gz", "zip", "mac zip"])
def test_every_article_of_a_kb_past_its_first_kilobyte_is_read(tmp_path, packing):
    """The E-VQA KB's first kilobyte is read to tell JSON from anything else, then streamed on from there."""
    kb = {f"https://en.wikipedia.org/wiki/A{i}": {**EVQA_KB[ZORVAK], "title": f"A{i}"} for i in range(30)}
    path = tmp_path / "encyclopedic_kb_wiki.json"
    path.write_text(json.dumps(kb))
    assert path.stat().st_size > 10 * 1024
    assert list(iter_evqa_kb(pack(path, packing))) == list(kb.items())


def test_upstream_jsonl_skips_blank_lines_and_names_a_bad_one(tmp_path):
    rows = [{"wikidata_id": "Q1"}, {"wikidata_id": "Q2"}]
    path = tmp_path / "Wiki6M_ver_1_0.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n  \n" + json.dumps(rows[1]) + "\n")
    assert list(read_upstream_jsonl(path)) == rows
    path.write_text(path.read_text() + "{oops\n")
    with pytest.raises(ValueError, match="Wiki6M_ver_1_0.jsonl:5: not valid JSON"):
        list(read_upstream_jsonl(path))
    kb = tmp_path / "kb.jsonl"  # mKG-RAG's E-VQA KB variant, one {url: article} a line
    kb.write_text("\n".join(["", json.dumps({ZORVAK: EVQA_KB[ZORVAK]}), " ", "[1]", ""]))
    with pytest.raises(ValueError, match="kb.jsonl:4: expected a JSON object"):
        list(iter_evqa_kb(kb))
    kb.write_text("\n".join(["", json.dumps({ZORVAK: EVQA_KB[ZORVAK]}), " ", ""]))
    assert list(iter_evqa_kb(kb)) == [(ZORVAK, EVQA_KB[ZORVAK])]


@pytest.mark.parametrize(
    "fmt,packing",
    [
        ("wiki6m", "gz"),
        ("wiki6m", "zip"),  # OVEN publishes Wiki6M_ver_1_0.jsonl.gz only
        ("evqa-kb", "zip"),
        ("evqa-kb", "gz"),  # encyclopedic_kb_wiki.zip, EchoSight's infoseek_100k_wiki.zip
        ("evqa-kb-jsonl", "gz"),  # mKG-RAG's JSONL variant, gzipped
        ("qid-map", "gz"),  # the QID → URL map straight from the .jsonl.gz
    ],
)
def test_kb_inputs_are_read_as_downloaded(tmp_path, fmt, packing):
    def run(where: Path) -> list:
        where.mkdir()
        if fmt == "evqa-kb":
            src = where / "encyclopedic_kb_wiki.json"
            src.write_text(json.dumps(EVQA_KB))
        elif fmt == "evqa-kb-jsonl":
            src = where / "kb.jsonl"
            src.write_text("".join(json.dumps({k: v}) + "\n" for k, v in EVQA_KB.items()))
        else:
            src = where / "Wiki6M_ver_1_0.jsonl"
            src.write_text("".join(json.dumps(r) + "\n" for r in wiki6m_rows()))
        src = pack(src, packing if where.name == "packed" else "plain")
        folder = image_folder(where, ["http://img/a.jpg", "http://img/eiffel.jpg"])
        out = where / ("m.tsv" if fmt == "qid-map" else "kb.jsonl")
        args = dict(format=fmt.removesuffix("-jsonl"), input=str(src), out=str(out))
        if fmt != "qid-map":
            args["image_dir"] = str(folder)
        n = convert(ConvertArgs(**args), log=quiet)
        assert n > 0
        text = out.read_text()
        if fmt != "qid-map":
            text += ArticleStore(store_path_for(out)).counts().__repr__()
        return text.replace(str(where), "")

    assert run(tmp_path / "packed") == run(tmp_path / "plain")


def test_the_image_urls_to_fetch_are_each_articles_once(tmp_path):
    from retrieval.upstream.fetch_images import kb_image_urls

    (tmp_path / "w.jsonl").write_text("".join(json.dumps(r) + "\n" for r in wiki6m_rows()))
    assert list(kb_image_urls(tmp_path / "w.jsonl", "wiki6m")) == ["http://img/eiffel.jpg"]  # null URLs left out
    kb = {
        ZORVAK: EVQA_KB[ZORVAK] | {"image_urls": ["http://img/a.jpg", "http://img/b.jpg", "http://img/a.jpg"]},
        "https://en.wikipedia.org/wiki/Null": {"title": "Null", "image_urls": None},
    }
    (tmp_path / "kb.json").write_text(json.dumps(kb))
    assert list(kb_image_urls(tmp_path / "kb.json", "evqa-kb")) == ["http://img/a.jpg", "http://img/b.jpg"]
    with pytest.raises(ValueError, match="--kb_format must be evqa-kb or wiki6m, got 'oven'"):
        list(kb_image_urls(tmp_path / "kb.json", "oven"))


UPLOAD = "https://upload.wikimedia.org/wikipedia"


@pytest.mark.parametrize(
    "url,png",
    [
        (f"{UPLOAD}/commons/a/ab/Flag.svg", f"{UPLOAD}/commons/thumb/a/ab/Flag.svg/960px-Flag.svg.png"),
        (f"{UPLOAD}/en/a/ab/Flag.svg?x=1", f"{UPLOAD}/en/thumb/a/ab/Flag.svg/960px-Flag.svg.png"),
        (f"{UPLOAD}/commons/a/ab/Flag.png", None),  # not an SVG
        (f"{UPLOAD}/commons/thumb/ab/Flag.svg", None),  # already a thumbnail folder
        ("https://upload.wikimedia.org/w/commons/a/ab/Flag.svg", None),
        (f"{UPLOAD}/commons/x/a/ab/Flag.svg", None),  # one folder too many
        (f"{UPLOAD}/a/ab/Flag.svg", None),  # one too few
        (f"{UPLOAD}/commons/aa/ab/Flag.svg", None),  # <x> is one character,
        (f"{UPLOAD}/commons/ab/ab/Flag.svg", None),
        (f"{UPLOAD}/commons/a/abc/Flag.svg", None),  # <xy> two,
        (f"{UPLOAD}/commons/a/bc/Flag.svg", None),  # beginning with <x>
    ],
)
def test_an_svg_in_wikimedias_upload_layout_has_a_png_rendering(url, png):
    from retrieval.upstream.fetch_images import wikimedia_png

    assert wikimedia_png(url, 960) == png


def test_a_url_shared_by_articles_is_fetched_once_and_limit_stops_the_run(tmp_path):
    from retrieval.upstream.fetch_images import FetchArgs, fetch_images
    from tests.upstream_site import Site, ok, png_bytes

    with Site({f"/{x}.png": [ok(png_bytes())] * 2 for x in "abc"}) as site:
        a, b, c = (site.url(f"/{x}.png") for x in "abc")
        kb = {ZORVAK: {**EVQA_KB[ZORVAK], "image_urls": [a]}, PARIS: {**EVQA_KB[ZORVAK], "image_urls": [a, b, c]}}
        (tmp_path / "kb.json").write_text(json.dumps(kb))
        args = dict(kb=str(tmp_path / "kb.json"), user_agent=UA, workers=1)
        assert fetch_images(FetchArgs(**args, out=str(tmp_path / "all")), log=quiet)["fetched"] == 3
        assert sorted(site.paths()) == ["/a.png", "/b.png", "/c.png"]
        trial = fetch_images(FetchArgs(**args, out=str(tmp_path / "trial"), limit=3), log=quiet)  # a, a, b
    assert trial == {"fetched": 2, "failed": 0, "already there": 1, "failed before": 0}
    assert sorted(p.name for p in (tmp_path / "trial").iterdir()) == sorted(f"{url_hash(u)}.png" for u in (a, b))


def test_fetch_images_reads_a_gzipped_wiki6m(tmp_path):
    import gzip

    from retrieval.upstream.fetch_images import FetchArgs, fetch_images
    from tests.upstream_site import Site, ok, png_bytes

    with Site({"/e.png": [ok(png_bytes())]}) as site:
        rows = [
            {
                "wikidata_id": "Q243",
                "wikipedia_title": "Eiffel Tower",
                "wikipedia_summary": "A tower.",
                "wikipedia_content": "A tower.",
                "wikipedia_image_url": site.url("/e.png"),
            }
        ]
        (tmp_path / "Wiki6M_ver_1_0.jsonl.gz").write_bytes(gzip.compress(json.dumps(rows[0]).encode() + b"\n"))
        counts = fetch_images(
            FetchArgs(
                kb=str(tmp_path / "Wiki6M_ver_1_0.jsonl.gz"),
                kb_format="wiki6m",
                out=str(tmp_path / "imgs"),
                user_agent=UA,
            ),
            log=quiet,
        )
    assert counts["fetched"] == 1 and (tmp_path / "imgs" / f"{url_hash(site.url('/e.png'))}.png").is_file()


def test_a_wiki6m_row_without_a_qid_is_named_and_one_without_a_title_has_an_empty_one():
    with pytest.raises(ValueError, match="Wiki6M row without wikidata_id"):
        wiki6m_article({"wikipedia_title": "Paris", "wikipedia_summary": "A city."}, None, quiet)
    row = {"wikidata_id": "Q90", "wikipedia_title": None, "wikipedia_summary": "A city."}
    article, rows = wiki6m_article(row, lambda r: ("Q90/Q90.jpg", None), quiet)
    assert article["title"] == rows[0]["title"] == "" and article["url"] is None


def test_wiki6m_images_through_an_image_map(tmp_path):
    root, _ = write_wiki6m(tmp_path)
    (tmp_path / "url2path.json").write_text(json.dumps({"http://img/eiffel.jpg": "w/eiffel.jpg"}))
    args = dict(format="wiki6m", input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"), out=str(tmp_path / "kb.jsonl"))
    convert(ConvertArgs(**args, images_root=str(root), image_map=str(tmp_path / "url2path.json")), log=quiet)
    assert {r["entity_id"]: r["image"] for r in read_jsonl(tmp_path / "kb.jsonl")} == {
        "Q243": "w/eiffel.jpg",
        "Q90": "Q90/Q90.jpg",
    }


def test_the_qid_map_from_wiki6m_takes_rows_with_a_qid_and_a_title():
    rows = [
        {"wikidata_id": "Q1", "wikipedia_title": "Eiffel Tower"},
        {"wikidata_id": "Q2", "wikipedia_title": ""},
        {"wikipedia_title": "Paris"},
    ]
    assert list(qid_map_from_wiki6m(rows)) == [("Q1", "https://en.wikipedia.org/wiki/Eiffel_Tower")]


@pytest.mark.parametrize(
    "entity,kb_keys,remapped",
    [
        ("Q90", None, PARIS),
        ("Q3", None, "Q3"),  # unmapped: unchanged
        (None, None, None),  # a test question's entity
        (["Q90", "Q3"], None, [PARIS, "Q3"]),  # 2-hop: per hop
        ("Q90", {canonical_url(PARIS): "http://en.wikipedia.org/wiki/Paris"}, "http://en.wikipedia.org/wiki/Paris"),
    ],
)
def test_an_entity_goes_through_the_qid_map_to_the_kbs_own_key(entity, kb_keys, remapped):
    assert remap_entity(entity, {"Q90": PARIS}, kb_keys) == remapped


@pytest.mark.parametrize(
    "name,text,mapping",
    [
        ("m.json", '{"Q90": "https://en.wikipedia.org/wiki/Paris", "Q1": 7}', {"Q90": PARIS, "Q1": "7"}),
        ("m.tsv", f"qid\turl\nQ90\t{PARIS}\nQ91\nQx9\tx\n12\tx\n", {"Q90": PARIS}),  # header, short, no QIDs
        ("m.csv", f"Q90,{PARIS},extra\n", {"Q90": PARIS}),
        ("m.json", '[["Q90", "https://en.wikipedia.org/wiki/Paris"]]', "expected a JSON object mapping QIDs"),
        ("m.csv", "qid,url\n", "no QID,URL rows found"),
    ],
)
def test_entity_maps_read_as_json_csv_or_tsv(tmp_path, name, text, mapping):
    (tmp_path / name).write_text(text)
    if isinstance(mapping, str):
        with pytest.raises(ValueError, match=f"{name}: {mapping}"):
            read_entity_map(tmp_path / name)
    else:
        assert read_entity_map(tmp_path / name) == mapping


@pytest.mark.parametrize(
    "qid,url,image,why",
    [
        ("Q90", "http://img/a.jpg", f"{url_hash('http://img/a.jpg')}.jpg", None),  # the URL's file first
        ("Q90", "http://img/flag.svg", "Q90/Q90.jpg", None),  # an SVG (PIL cannot read it): UniIR's layout
        ("Q91", "http://img/flag.svg", None, "SVG image "),
        ("Q91", "http://img/gone.jpg", None, "no local file for http://img/gone.jpg and none of Q91/Q91.jpg, "),
        ("Q91", None, None, "no image url and none of Q91/Q91.jpg, Q91/Q91.JPEG under "),
    ],
)
def test_a_wiki6m_image_is_the_urls_file_else_unirs_layout(tmp_path, qid, url, image, why):
    folder = image_folder(tmp_path, ["http://img/a.jpg"])
    (folder / f"{url_hash('http://img/flag.svg')}.svg").write_bytes(b"<svg/>")
    (tmp_path / "Q90").mkdir()
    (tmp_path / "Q90" / "Q90.jpg").write_bytes(b"x")
    find = wiki6m_image_finder(tmp_path, image_resolver(None, folder))
    found, reason = find({"wikidata_id": qid, "wikipedia_image_url": url})
    assert found == image and (reason is None if why is None else reason.startswith(why))


@pytest.mark.parametrize(
    "index,section",
    [
        (1, 1),
        (3, 3),  # the last section
        (4, 0),  # past the last: the first section
        (-1, 0),  # not an index into the sections (Python's last): the first section
        (2, 0),  # an empty section: the first
        ("1", 0),
    ],
)
def test_an_evqa_image_is_paired_with_its_section_or_the_first(index, section):
    art = {**EVQA_KB[ZORVAK], "image_urls": ["http://img/a.jpg"], "image_section_indices": [index]}
    _, (row,) = evqa_article(ZORVAK, art, lambda u: "a.jpg", quiet)
    assert row["section"] == section and row["text"] == EVQA_KB[ZORVAK]["section_texts"][section]


def test_an_evqa_article_with_images_but_no_section_text_is_listed():
    skipped = []
    art = {"title": "Empty", "section_texts": [], "image_urls": ["http://img/a.jpg"], "image_section_indices": [0]}
    article, rows = evqa_article("https://x/wiki/Empty", art, lambda u: "a.jpg", skipped.append)
    assert rows == [] and article["sections"] == []
    assert skipped == [{"entry_id": "https://x/wiki/Empty#image0", "reason": "article has no section text"}]


@pytest.mark.parametrize(
    "summary,content,sections,text",
    [
        ("A tower.", "A tower. Built 1889.", ["A tower.", "A tower. Built 1889."], "A tower."),
        ("", "Only content.", ["Only content."], "Only content."),  # the store's section 0 holds what is embedded
        (None, "Only content.", ["Only content."], "Only content."),
        ("A tower.", "", ["A tower."], "A tower."),
        ("A tower.", "A tower.", ["A tower."], "A tower."),
        ("", "", [""], None),  # nothing to embed: listed, article kept
        ("", None, [""], None),
    ],
)
def test_wiki6m_index_row_text_is_the_store_section(tmp_path, summary, content, sections, text):
    row = {
        "wikidata_id": "Q243",
        "wikipedia_title": "Eiffel Tower",
        "wikipedia_summary": summary,
        "wikipedia_content": content,
        "wikipedia_image_url": "http://img/eiffel.jpg",
    }
    (tmp_path / "w.jsonl").write_text(json.dumps(row) + "\n")
    folder = image_folder(tmp_path, ["http://img/eiffel.jpg"])
    convert(
        ConvertArgs(
            format="wiki6m", input=str(tmp_path / "w.jsonl"), image_dir=str(folder), out=str(tmp_path / "kb.jsonl")
        ),
        log=quiet,
    )
    store = ArticleStore(store_path_for(tmp_path / "kb.jsonl"))
    assert [(s["section"], s["text"]) for s in store.sections("Q243")] == list(enumerate(sections))
    rows = list(read_jsonl(tmp_path / "kb.jsonl"))
    if text is None:
        (skip,) = read_jsonl(tmp_path / "kb.jsonl.skipped.jsonl")
        assert rows == [] and "no text" in skip["reason"] and "Q243" in store
    else:
        assert [r["text"] for r in rows] == [text] and store.entry(rows[0]["entry_id"])["text"] == text


@pytest.mark.parametrize(
    "source,match",
    [
        ("csv", "no data_id of .*infoseek_test_filtered.csv is in .*withkb.jsonl"),  # ids that do not join
        ("wiki6m", "no row of .*Wiki6M_ver_1_0.jsonl has both wikidata_id and wikipedia_title"),
    ],
)
def test_qid_map_with_nothing_to_join_is_an_error(tmp_path, source, match):
    if source == "csv":
        with open(tmp_path / "infoseek_test_filtered.csv", "w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["data_id", "wikipedia_url"])
            w.writeheader()
            w.writerow({"data_id": "infoseek_val_1", "wikipedia_url": "https://en.wikipedia.org/wiki/Paris"})
        (tmp_path / "withkb.jsonl").write_text('{"data_id": "infoseek_train_7", "entity_id": "Q90"}\n')
        args = ConvertArgs(
            format="qid-map",
            input=str(tmp_path / "infoseek_test_filtered.csv"),
            withkb=str(tmp_path / "withkb.jsonl"),
            out=str(tmp_path / "m.tsv"),
        )
    else:
        (tmp_path / "Wiki6M_ver_1_0.jsonl").write_text('{"wikidata_id": "Q1", "wikipedia_title": null}\n')
        args = ConvertArgs(format="qid-map", input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"), out=str(tmp_path / "m.tsv"))
    with pytest.raises(ValueError, match=match):
        convert(args, log=quiet)
    assert not (tmp_path / "m.tsv").exists()


@pytest.mark.parametrize(
    "title,kept",
    [
        ("History", True),
        ("See also", True),
        ("Reference works", True),
        ("Further reading", True),
        ("References", False),
        ("REFERENCES", False),
        ("Notes and references", False),
        ("External links", False),
        ("External links and further reading", False),
    ],
)
def test_sections_skipped_when_the_title_contains_a_skipped_word(tmp_path, title, kept):
    from retrieval.upstream.articles import ArticleWriter

    with ArticleWriter(tmp_path / "a.sqlite") as w:
        w.add_article("E", "Entity", None, [(0, "Entity", "lead"), (1, title, "text")])
    titles = [
        s["section_title"]
        for s in ArticleStore(tmp_path / "a.sqlite").sections("E", skip_titles=("external links", "references"))
    ]  # gate.pipeline.stages.SKIPPED_SECTIONS, as EchoSight
    assert titles == (["Entity", title] if kept else ["Entity"])


@pytest.mark.parametrize(
    "table,key", [("articles", "entity_id"), ("sections", "(entity_id, idx)"), ("entries", "entry_id")]
)
def test_a_duplicate_among_the_last_rows_leaves_no_temporary_store(tmp_path, table, key):
    """The rows still pending at the end are written as the writer closes: a duplicate key there is refused, naming
    the key, and the half-written temporary beside the store went only when the writer was garbage-collected."""
    from retrieval.upstream.articles import ArticleWriter

    writer = ArticleWriter(tmp_path / "a.sqlite")
    with pytest.raises(ValueError, match=re.escape(f"a duplicate {key} in {table} (")), writer as w:
        w.add_article("E", "Entity", None, [(0, "Entity", "lead")] * (2 if table == "sections" else 1))
        w.add_entry("E#image0", "E", 0, "a.jpg")
        if table == "articles":
            w.add_article("E", "Entity", None, [])
        if table == "entries":
            w.add_entry("E#image0", "E", 0, "b.jpg")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    del writer  # held above, so the check did not rest on garbage collection


def test_title_keyed_image_csvs_keep_the_first_images_of_a_title_and_list_short_rows(tmp_path):
    for name in "abcd":
        (tmp_path / f"{name}.jpg").write_bytes(b"x")
    with open(tmp_path / "part_1.csv", "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows(
            [
                ["title", "url", "path"],
                ["Zorvak", "u0", "a.jpg"],  # exactly the three columns read
                ["Zorvak", "u1"],
                ["Zorvak", "u2", "b.jpg", "a caption"],
                ["Zorvak", "u3", "c.jpg"],  # a third image, past per_title=2
                ["Paris", "u4", "d.jpg"],
            ]
        )
    skipped = []
    assert title_images([tmp_path / "part_1.csv"], tmp_path, skipped.append, per_title=2) == {
        "Zorvak": ["a.jpg", "b.jpg"],
        "Paris": ["d.jpg"],
    }
    assert [(s["row"], s["reason"].split(" (")[0]) for s in skipped] == [
        (3, "fewer than 3 columns"),
        (5, "more than 2 images for this title"),
    ]


@pytest.mark.parametrize(
    "image,file,outcome",
    [
        ("split1/zorvak_0.jpg", True, "row"),
        ("split1/not_downloaded.jpg", False, "no file"),  # listed, never a row pointing nowhere
        ("split1/flag.svg", True, "SVG"),  # a file PIL cannot decode: listed
    ],
)
def test_title_keyed_image_csvs_list_what_they_leave_out(tmp_path, image, file, outcome):
    root = tmp_path / "wiki_images"
    root.mkdir()
    if file:
        (root / image).parent.mkdir(parents=True, exist_ok=True)
        (root / image).write_bytes(b"x")
    with open(tmp_path / "wiki_image_url_part_1.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["title", "url", "path", "caption"])
        w.writerow(["Zorvak", "u0", image, ""])
    (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    args = dict(
        format="evqa-kb",
        input=str(tmp_path / "kb.json"),
        out=str(tmp_path / "kb.jsonl"),
        image_csv=str(tmp_path / "wiki_image_url_part_*.csv"),
    )
    with pytest.raises(ValueError, match="--image_csv needs --images_root"):
        convert(ConvertArgs(**args), log=quiet)
    n = convert(ConvertArgs(**args, images_root=str(root)), log=quiet)
    skipped = list(read_jsonl(tmp_path / "kb.jsonl.skipped.jsonl"))
    no_image = [s for s in skipped if s.get("entity_id") == "https://en.wikipedia.org/wiki/No_picture"]
    assert len(no_image) == 1 and "no image" in no_image[0]["reason"]  # an article that gets no image is listed
    if outcome == "row":
        assert n == 1 and next(read_jsonl(tmp_path / "kb.jsonl"))["image"] == image
        assert skipped == no_image  # the header row is no image
    else:
        (left,) = [s for s in skipped if s.get("image") == image]
        assert n == 0 and outcome in left["reason"] and left["csv"].endswith("wiki_image_url_part_1.csv")
        assert left["row"] == 2  # the CSV's line, its header line 1
        zorvak = [s for s in skipped if s.get("entity_id") == ZORVAK]
        assert len(zorvak) == 1 and "no image" in zorvak[0]["reason"]


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(kb=None), "--kb: None is not a file"),
        (dict(kb="/nonexistent/gone.json"), "--kb: /nonexistent/gone.json is not a file"),
        (dict(out=None), "--out: a folder is required"),
        (dict(workers=0), "--workers must be ≥ 1, got 0"),
        (dict(max_retries=-1), "--max_retries must be ≥ 0 and --svg_width ≥ 1, got -1, 960"),
        (dict(svg_width=0), "--max_retries must be ≥ 0 and --svg_width ≥ 1, got 5, 0"),
        (dict(workers=1, max_retries=0, svg_width=1), None),  # the least each takes
    ],
)
def test_fetch_images_refuses_bad_arguments_before_fetching(tmp_path, changes, match):
    from retrieval.upstream.fetch_images import FetchArgs, fetch_images

    kb = kb_with_images(tmp_path, ["http://127.0.0.1:9/a.png"])  # nothing listens there: refused at once
    args = FetchArgs(**dict(kb=str(kb), out=str(tmp_path / "imgs"), user_agent=UA) | changes)
    if match is None:
        args.out = str(tmp_path / "data" / "evqa" / "kb_images")  # as the recipe names it, its parents made
        assert fetch_images(args, log=quiet)["failed"] == 1
    else:
        with pytest.raises(ValueError, match=match):
            fetch_images(args, log=quiet)
        assert not (tmp_path / "imgs").exists()


@pytest.mark.parametrize(
    "user_agent,ok",
    [
        (None, False),
        ("refine-rl image fetcher", False),
        ("", False),
        ("Jane Doe (jane@example.org)", True),
        ("KBFetch/1.0 (https://example.org/me) python", True),
        ("@", False),  # an @ or :// alone names nobody
        ("refine-rl @ home", False),
        ("x://", False),
    ],
)
def test_fetch_images_needs_a_user_agent_with_a_contact(tmp_path, user_agent, ok):
    from retrieval.upstream.fetch_images import FetchArgs, fetch_images
    from tests.upstream_site import Site, png_bytes
    from tests.upstream_site import ok as served

    with Site({"/a.png": [served(png_bytes())]}) as site:
        kb = kb_with_images(tmp_path, [site.url("/a.png")])
        args = FetchArgs(kb=str(kb), out=str(tmp_path / "imgs"), user_agent=user_agent)
        if not ok:
            with pytest.raises(ValueError, match="--user_agent"):
                fetch_images(args, log=quiet)
            assert site.requests == []
        else:
            fetch_images(args, log=quiet)
            assert site.requests == [("/a.png", user_agent)]


@pytest.mark.parametrize(
    "responses,sleeps,fetched",
    [
        ([(429, {"Retry-After": "3"})], [3], True),  # the server's Retry-After, in seconds
        ([(429, {}), (429, {})], [1, 2], True),  # no Retry-After: exponential back-off
        ([(503, {"Retry-After": "2"})], [2], True),
        ([(429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})], [], True),  # a date already past: no wait
        ([(429, {"Retry-After": "1"})] * 3, [1, 1], False),  # still 429 after --max_retries: listed as failed
    ],
)
def test_fetch_images_backs_off_on_429(tmp_path, monkeypatch, responses, sleeps, fetched):
    import retrieval.upstream.fetch_images as fi
    from tests.upstream_site import Site, ok, png_bytes

    slept = []
    monkeypatch.setattr(fi, "_sleep", slept.append)
    with Site({"/a.png": [(s, h, b"") for s, h in responses] + [ok(png_bytes())]}) as site:
        kb = kb_with_images(tmp_path, [site.url("/a.png")])
        counts = fi.fetch_images(
            fi.FetchArgs(kb=str(kb), out=str(tmp_path / "imgs"), user_agent=UA, max_retries=2), log=quiet
        )
    assert [round(s) for s in slept] == sleeps
    assert counts["fetched"] == int(fetched) and counts["failed"] == int(not fetched)
    if not fetched:
        (failed,) = read_jsonl(tmp_path / "imgs" / "failed.jsonl")
        assert "429" in failed["reason"]


@pytest.mark.parametrize(
    "damage,match",
    [
        ("truncated gz", "truncated or corrupt"),
        ("zip of two data files", "one .json/.jsonl/.csv file, found a.jsonl, b.jsonl"),
        ("zip of no data file", "one .json/.jsonl/.csv file, found README.txt;"),
        ("empty zip", "one .json/.jsonl/.csv file, found nothing;"),
    ],
)
def test_a_damaged_or_ambiguous_download_is_refused_naming_it(tmp_path, damage, match):
    import gzip
    import zipfile

    rows = "".join(json.dumps(r) + "\n" for r in wiki6m_rows() * 50)
    if damage == "truncated gz":
        path = tmp_path / "Wiki6M_ver_1_0.jsonl.gz"
        path.write_bytes(gzip.compress(rows.encode())[:-40])
    else:
        path = tmp_path / "kb.zip"
        with zipfile.ZipFile(path, "w") as z:
            if damage == "zip of two data files":
                z.writestr("a.jsonl", rows)
                z.writestr("b.jsonl", rows)
            elif damage == "zip of no data file":
                z.writestr("README.txt", "see the website")
    with pytest.raises(ValueError, match=f"{path.name}.*{match}"):
        convert(ConvertArgs(format="wiki6m", input=str(path), out=str(tmp_path / "kb.jsonl")), log=quiet)
    assert not (tmp_path / "kb.jsonl").exists()


def test_a_connection_dropped_mid_image_is_listed_as_failed_and_the_run_goes_on(tmp_path):
    """http.client's IncompleteRead is no OSError: one such URL among millions is listed in failed.jsonl, not the end
    of the run (and of every rerun); a failed.jsonl whose last line a crash cut short is read on, and rewritten."""
    from retrieval.upstream.fetch_images import FetchArgs, fetch_images
    from tests.upstream_site import Site, png_bytes
    from tests.upstream_site import ok as served

    cut = (200, {"Content-Type": "image/png", "Content-Length": "1000"}, png_bytes())
    with Site({"/a.png": [served(png_bytes())], "/cut.png": [cut]}) as site:
        kb = kb_with_images(tmp_path, [site.url("/cut.png"), site.url("/a.png")])
        args = FetchArgs(kb=str(kb), out=str(tmp_path / "imgs"), user_agent=UA, workers=1, timeout=5)
        assert fetch_images(args, log=quiet) == {"fetched": 1, "failed": 1, "already there": 0, "failed before": 0}
        (failed,) = read_jsonl(tmp_path / "imgs" / "failed.jsonl")
        assert failed["url"] == site.url("/cut.png") and "IncompleteRead" in failed["reason"]
        with open(tmp_path / "imgs" / "failed.jsonl", "a", encoding="utf-8") as fh:
            fh.write('{"url": "http://cut')  # a crash mid-append
        # a dropped connection may pass: the rerun tries it again (cut again), and failed.jsonl lists it once
        assert fetch_images(args, log=quiet) == {"fetched": 0, "failed": 1, "already there": 1, "failed before": 0}
        assert [r["url"] for r in read_jsonl(tmp_path / "imgs" / "failed.jsonl")] == [site.url("/cut.png")]


def test_odd_kb_entries_convert_or_are_named():
    """An E-VQA KB entry that is not an article object is an error naming its URL (not an AttributeError); a lone
    section written as a bare string is one section, not one per character; a section index pointing at a null text
    falls back to the first section, like an empty one."""
    from retrieval.upstream.kb import evqa_article

    skipped = []
    with pytest.raises(ValueError, match="the entry for 'https://x/wiki/A' is NoneType, not an article object"):
        evqa_article("https://x/wiki/A", None, lambda u: None, skipped.append)
    art, _ = evqa_article(
        "https://x/wiki/B",
        {"title": "B", "section_titles": "Intro", "section_texts": "Some lead text"},
        None,
        skipped.append,
    )
    assert art["sections"] == [(0, "Intro", "Some lead text")]
    art, rows = evqa_article("https://x/wiki/D", {"section_texts": ["Lead."], "image_urls": ["u"]}, str, quiet)
    assert art["entity_id"] == rows[0]["entity_id"] == "https://x/wiki/D"  # no "url": the KB's key
    # an entry whose own "url" differs from its key is the entity of its "url", as EchoSight's loader reads it
    # (WikipediaKnowledgeBaseEntry.url: the id its retrieval returns and its recall compares with wikipedia_url)
    own, _ = evqa_article("https://x/wiki/Key", {"url": "https://x/wiki/Own", "section_texts": ["L."]}, str, quiet)
    assert own["entity_id"] == own["url"] == "https://x/wiki/Own"
    assert art["title"] == rows[0]["title"] == ""
    art = {
        "title": "C",
        "section_titles": ["Intro", "Habitat"],
        "section_texts": ["Lead.", None],
        "image_urls": ["https://img/c.jpg"],
        "image_section_indices": [1],
    }
    art, rows = evqa_article("https://x/wiki/C", art, lambda u: "c.jpg", skipped.append)
    assert [r["section"] for r in rows] == [0] and rows[0]["text"] and "None" not in rows[0]["text"]
    assert art["sections"] == [(0, "Intro", "Lead."), (1, "Habitat", "")]


def test_an_empty_body_or_a_page_without_content_type_is_not_saved_as_an_image(tmp_path):
    """A 0-byte reply and an HTML page sent without a Content-Type were saved as images and counted as fetched: never
    listed in failed.jsonl, so --retry_failed could not recover them, and the converter made index rows of them."""
    from retrieval.upstream.fetch_images import fetch_one, file_name
    from tests.upstream_site import Site, png_bytes

    routes = {
        "/empty.jpg": [(200, {"Content-Type": "image/jpeg"}, b"")],
        "/notype/page": [(200, {}, b"<html>Error</html>")],
        "/notype/ok": [(200, {}, png_bytes())],
    }
    with Site(routes) as site:
        out = tmp_path / "imgs"
        out.mkdir()
        fetch = lambda path: fetch_one(site.url(path), out, 5, UA)  # noqa: E731
        assert fetch("/empty.jpg") == "empty body (0 bytes, Content-Type image/jpeg)"
        assert fetch("/notype/page") == "not an image (no Content-Type, and PIL cannot read the body as one)"
        assert fetch("/notype/ok") is None
        assert [p.name for p in out.iterdir()] == [file_name(site.url("/notype/ok"))]


def test_an_svg_served_without_a_content_type_is_rasterised_by_its_name(tmp_path, monkeypatch):
    import retrieval.upstream.fetch_images as fi
    from tests.upstream_site import SVG, Site, png_bytes

    monkeypatch.setattr(fi, "svg_rasteriser", lambda: lambda data, width: png_bytes())
    with Site({"/static/logo.svg": [(200, {}, SVG)]}) as site:
        assert fi.fetch_one(site.url("/static/logo.svg"), tmp_path, 5, UA) is None
    (saved,) = tmp_path.iterdir()
    assert saved.name == f"{url_hash(site.url('/static/logo.svg'))}.png" and saved.read_bytes() == png_bytes()


def test_a_content_type_is_read_without_its_parameters_or_case(tmp_path):
    from retrieval.upstream.fetch_images import fetch_one, file_name
    from tests.upstream_site import Site, ok, png_bytes

    with Site({"/a.png": [ok(png_bytes(), "Image/PNG; charset=binary")]}) as site:
        assert fetch_one(site.url("/a.png"), tmp_path, 5, UA) is None
        assert (tmp_path / file_name(site.url("/a.png"))).read_bytes() == png_bytes()


def test_a_url_with_non_ascii_characters_or_spaces_is_fetched_under_the_name_of_the_url_as_listed(tmp_path):
    """urllib refuses a non-ASCII or spaced URL (UnicodeEncodeError, InvalidURL): Wikimedia file names often hold
    such characters, and each was listed as failed for good."""
    from retrieval.upstream.fetch_images import fetch_one, file_name
    from tests.upstream_site import Site, ok, png_bytes

    routes = {"/Caf%C3%A9_Paris.png": [ok(png_bytes())], "/A%20file%20with%20spaces.png": [ok(png_bytes())]}
    with Site(routes) as site:
        for listed in (site.url("/Café_Paris.png"), site.url("/A file with spaces.png")):
            assert fetch_one(listed, tmp_path, 5, UA) is None
            assert (tmp_path / file_name(listed)).stat().st_size > 0
        assert sorted(site.paths()) == sorted(routes)


def test_a_store_that_fails_to_finish_leaves_no_kb_rows_in_place(tmp_path, monkeypatch):
    """kb.jsonl was renamed into place before the store's last flush, index and commit: when those failed (a full
    disk), the KB stood without its store, and the pipeline quietly built one from the rows (a section each)."""
    import sqlite3

    from retrieval.upstream import articles

    folder = image_folder(tmp_path, ["http://img/a.jpg", "http://img/b.jpg", "http://img/c.jpg", "http://img/d.jpg"])
    (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    real_exit = articles.ArticleWriter.__exit__

    def disk_full(self, exc_type, exc, tb):
        if exc_type is None:
            self.db.close()
            self._atomic.__exit__(sqlite3.OperationalError, None, None)
            raise sqlite3.OperationalError("database or disk is full")
        return real_exit(self, exc_type, exc, tb)

    monkeypatch.setattr(articles.ArticleWriter, "__exit__", disk_full)
    args = ConvertArgs(
        format="evqa-kb", input=str(tmp_path / "kb.json"), image_dir=str(folder), out=str(tmp_path / "o" / "kb.jsonl")
    )
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        convert(args, log=quiet)
    assert not (tmp_path / "o" / "kb.jsonl").exists() and not store_path_for(tmp_path / "o" / "kb.jsonl").exists()


def test_a_lone_surrogate_in_an_upstream_row_becomes_a_replacement_character(tmp_path):
    """A JSON escape of half a UTF-16 pair (text cut mid-emoji) decodes to a lone surrogate, which no UTF-8 file can
    hold: it is read as U+FFFD, and the conversion goes on."""
    rows = wiki6m_rows()
    rows[-1]["wikipedia_content"] = "Capital of France \ud83d. Big."  # json.dumps writes it as the escape \ud83d
    rows[-1]["wikipedia_title"] = "Paris \udc00"
    root, folder = write_wiki6m(tmp_path, rows)
    assert "\\ud83d" in (tmp_path / "Wiki6M_ver_1_0.jsonl").read_text()
    n = convert_wiki6m(tmp_path, root, folder)
    rows = {r["entity_id"]: r for r in read_jsonl(tmp_path / "kb.jsonl")}
    assert n == 2 and rows["Q90"]["title"] == "Paris \ufffd"
    store = ArticleStore(store_path_for(tmp_path / "kb.jsonl"))
    assert [s["text"] for s in store.sections("Q90")][-1] == "Capital of France \ufffd. Big."
    emoji = json.loads('{"t": "\\ud83d\\ude00"}')["t"]  # a whole pair is one character, kept
    assert json_record(json.dumps({"t": emoji}), "x", 1)["t"] == "\U0001f600"


def test_a_lone_surrogate_in_the_evqa_kb_json_is_named_or_read_as_a_replacement_character(tmp_path, monkeypatch):
    import ijson

    from retrieval.upstream.kb import iter_evqa_kb

    kb = json.loads(json.dumps(EVQA_KB))
    kb[ZORVAK]["section_texts"][1] = "It lives in caves \udc00."  # yajl2_c reads a lone high one as "?"
    (tmp_path / "kb.json").write_text(json.dumps(kb))
    if ijson.backend == "yajl2_c":  # the default where its wheel installs: refuses, naming the file and the way out
        with pytest.raises(
            ValueError, match=r"kb\.json: text that is not UTF-8 after article 0 .*IJSON_BACKEND=python"
        ):
            list(iter_evqa_kb(tmp_path / "kb.json"))
    monkeypatch.setattr(ijson, "kvitems", ijson.get_backend("python").kvitems)  # as IJSON_BACKEND=python selects
    articles = dict(iter_evqa_kb(tmp_path / "kb.json"))
    assert articles[ZORVAK]["section_texts"][1] == "It lives in caves \ufffd."
    assert articles[ZORVAK]["section_texts"][0] == EVQA_KB[ZORVAK]["section_texts"][0] and len(articles) == 2


def test_a_failure_that_may_pass_is_tried_again_by_the_next_run_and_failed_jsonl_keeps_one_line_per_url(tmp_path):
    """A timeout or a 5xx among millions of downloads was listed like a 404, for good unless --retry_failed (which
    retried the 404s too), and each retry appended the URL again, a fetched one included."""
    from retrieval.upstream.fetch_images import TRANSIENT, FetchArgs, fetch_images, file_name
    from tests.upstream_site import Site, ok, png_bytes

    routes = {"/flaky.png": [(500, {}, b"busy"), ok(png_bytes())], "/a.png": [ok(png_bytes())]}  # /gone.png: 404
    with Site(routes) as site:
        urls = [site.url(p) for p in ("/flaky.png", "/gone.png", "/a.png")]
        kb = kb_with_images(tmp_path, urls)
        args = FetchArgs(kb=str(kb), out=str(tmp_path / "imgs"), user_agent=UA, workers=1, timeout=5)
        failed_log = tmp_path / "imgs" / "failed.jsonl"
        assert fetch_images(args, log=quiet) == {"fetched": 1, "failed": 2, "already there": 0, "failed before": 0}
        reasons = {r["url"]: r["reason"] for r in read_jsonl(failed_log)}
        assert reasons[urls[0]].startswith(TRANSIENT + "HTTPError") and "500" in reasons[urls[0]]
        assert not reasons[urls[1]].startswith(TRANSIENT) and "404" in reasons[urls[1]]
        # the next run tries the 500 again (now served), not the 404; the fetched URL leaves failed.jsonl
        said = []  # the 404 is not "already there": it is a failure for good, said as one
        assert fetch_images(args, log=said.append) == {
            "fetched": 1,
            "failed": 0,
            "already there": 1,
            "failed before": 1,
        }
        assert "1 failed for good in an earlier run (--retry_failed tries them again)" in said[-1]
        assert (tmp_path / "imgs" / file_name(urls[0])).read_bytes() == png_bytes()
        assert [r["url"] for r in read_jsonl(failed_log)] == [urls[1]]
        assert site.paths().count("/gone.png") == 1
        # --retry_failed tries the 404 again; failed.jsonl still holds it once
        retry = FetchArgs(**{**vars(args), "retry_failed": True})
        assert fetch_images(retry, log=quiet) == {"fetched": 0, "failed": 1, "already there": 2, "failed before": 0}
        (again,) = read_jsonl(failed_log)
        assert again["url"] == urls[1] and site.paths().count("/gone.png") == 2


def urllib_error(kind: str) -> Exception:
    """What urllib raises for a download that timed out, was refused, was cut mid-body, or named no valid URL."""
    import http.client
    import urllib.error

    return {
        "timeout": TimeoutError("The read operation timed out"),
        "refused": urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")),
        "incomplete": http.client.IncompleteRead(b"", 10),
        "bad url": ValueError("unknown url type: 'x'"),
    }[kind]


@pytest.mark.parametrize(
    "error,passes",
    [
        (urllib_error("timeout"), True),
        (urllib_error("refused"), True),
        (urllib_error("incomplete"), True),
        (urllib_error("bad url"), False),
    ],
)
def test_which_download_errors_may_pass(error, passes, monkeypatch):
    import retrieval.upstream.fetch_images as fi

    def urlopen(*a, **k):
        raise error

    monkeypatch.setattr(fi.urllib.request, "urlopen", urlopen)  # the error urllib raises, not a server's reply
    kind, why = fi.download("http://x/a.png", 5, UA, fi.Throttle(), 0)
    assert kind is None and why.startswith(fi.TRANSIENT) == passes and type(error).__name__ in why


@pytest.mark.parametrize(
    "reason,kind",
    [
        ("no local file for image https://upload.wikimedia.org/a/b.jpg", "no local file for image"),
        ("no local file for image http://x.org/b.jpg", "no local file for image"),
        (
            "2_hop question, left out as the papers do (--include_two_hop keeps it)",
            "2_hop question, left out as the papers do",
        ),
        ("no entity_id (not in the withkb file); convert with --require_entity false for inference", "no entity_id"),
        ("fewer than 3 columns (2)", "fewer than 3 columns"),
        ("unknown question_type 'templated'", "unknown question_type"),
        ("SVG image /data/kb/x.svg: PIL cannot decode it", "SVG image"),
        ("no image file under /data/images: tried a.jpg, b.jpg", "no image file under"),
        ("image file missing: /data/q.png", "image file missing"),
        ("article has no section text", "article has no section text"),
        ("(odd)", "(odd)"),  # nothing before the details: the reason itself
        (": odd", ": odd"),
    ],
)
def test_the_skipped_summary_counts_each_reason_without_its_details(reason, kind):
    """Counted by the reason's first 60 characters cut at a colon, skips were grouped by URL scheme ("no local file
    for image https"), and a hint was cut mid-flag ("convert with --requir")."""
    from retrieval.upstream.convert import reason_kind

    assert reason_kind(reason) == kind


def test_non_ascii_kb_text_converts_under_a_locale_that_is_not_utf8(tmp_path):
    """Every text file is read and written as UTF-8, whatever the locale: under LC_ALL=C without Python's UTF-8
    coercion the locale's encoding is ASCII, and a KB title with an accent stopped the converter (its outputs were
    opened without an encoding)."""
    import os
    import subprocess
    import sys

    rows = wiki6m_rows()
    rows[-2] = {**rows[-2], "wikipedia_title": "Tour Eiffel — à Paris", "wikipedia_summary": "Une tour à Paris."}
    root, folder = write_wiki6m(tmp_path, rows)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    assert subprocess.run(
        [sys.executable, "-c", "import locale; print(locale.getpreferredencoding())"], env=env, capture_output=True
    ).stdout.strip() in (b"ANSI_X3.4-1968", b"ascii", b"US-ASCII")  # the locale this test means
    argv = ["--format", "wiki6m", "--input", str(tmp_path / "Wiki6M_ver_1_0.jsonl"), "--images_root", str(root)]
    argv += ["--image_dir", str(folder), "--out", str(tmp_path / "kb.jsonl")]
    done = subprocess.run(
        [sys.executable, "-m", "retrieval.upstream.convert", *argv], env=env, cwd=repo, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["entity_id"]: r for r in read_jsonl(tmp_path / "kb.jsonl")}
    assert rows["Q243"]["title"] == "Tour Eiffel — à Paris" and rows["Q243"]["text"] == "Une tour à Paris."
