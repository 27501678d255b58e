"""KB converters and the article store: the E-VQA KB format (JSON streamed, and the JSONL variant), Wiki6M (a real
row from tests/data/realdata, real rows copied into the repository), title-keyed image CSVs, the QID → URL map, the KB check, and the toy world's KB going
through the store unchanged."""

import csv
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrieval.articles import ArticleStore, store_from_kb_rows, store_path_for
from retrieval.convert import ConvertArgs, convert
from retrieval.files import read_jsonl
from retrieval.upstream_kb import canonical_url, url_hash, wiki6m_url

REAL = Path(__file__).resolve().parent / "data" / "realdata"  # real rows, their sources in SOURCES.md
ZORVAK = "https://en.wikipedia.org/wiki/Zorvak"
EVQA_KB = {
    ZORVAK: {
        "title": "Zorvak", "url": ZORVAK,
        "section_titles": ["Zorvak", "Habitat", "Diet", "References"],
        "section_texts": ["The Zorvak is a red star.", "It lives in caves.", "", "Smith 2001."],
        "image_urls": ["http://img/a.jpg", "http://img/b.jpg", "http://img/c.jpg", "http://img/d.jpg",
                       "http://img/dead.jpg"],
        "image_reference_descriptions": ["", "", "", "", ""],
        "image_section_indices": [1, None, 2, 7],  # d.jpg: out of range; dead.jpg: no index at all
    },
    "https://en.wikipedia.org/wiki/No_picture": {  # an article with sections but no image still matters
        "title": "No picture", "url": "https://en.wikipedia.org/wiki/No_picture",
        "section_titles": ["No picture", "History"], "section_texts": ["A place.", "Built in 1900."],
        "image_urls": [], "image_reference_descriptions": [], "image_section_indices": [],
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
    n = convert(ConvertArgs(format="evqa-kb", input=str(tmp_path / f"kb.{variant}"), image_dir=str(folder),
                            out=str(tmp_path / "out" / "kb.jsonl")), log=quiet)
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
    assert [s["section_title"] for s in store.sections(ZORVAK, skip_titles=["references"])] == \
        ["Zorvak", "Habitat", "Diet"]
    assert [s["text"] for s in store.sections("https://en.wikipedia.org/wiki/No_picture")] == \
        ["A place.", "Built in 1900."]
    for r in rows:  # every index row is reachable by its entry id, with the same text
        e = store.entry(r["entry_id"])
        assert {k: e[k] for k in r} == r
    assert store.entry("nope") is None and "nope" not in store and ZORVAK in store


def test_evqa_kb_with_title_keyed_image_csvs(tmp_path):
    root = tmp_path / "wiki_images"
    for rel in ("split1/zorvak_0.jpg", "split1/zorvak_1.jpg"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    with open(tmp_path / "wiki_image_url_part_1.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["title", "url", "path", "caption"])
        w.writerow(["Zorvak", "u0", "split1/zorvak_0.jpg", "a star"])
        w.writerow(["Zorvak", "u0", "split1/zorvak_0.jpg", "again"])       # duplicate path: once
        w.writerow(["Zorvak", "u1", "split1/zorvak_1.jpg", ""])
        w.writerow(["Zorvak", "u2", "split1/not_downloaded.jpg", ""])     # no file: left out, as their loaders do
    (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    n = convert(ConvertArgs(format="evqa-kb", input=str(tmp_path / "kb.json"), images_root=str(root),
                            image_csv=str(tmp_path / "wiki_image_url_part_*.csv"), out=str(tmp_path / "kb.jsonl")),
                log=quiet)
    rows = list(read_jsonl(tmp_path / "kb.jsonl"))
    assert n == 2 and [r["image"] for r in rows] == ["split1/zorvak_0.jpg", "split1/zorvak_1.jpg"]
    assert all(r["section"] == 0 and r["entity_id"] == ZORVAK for r in rows)


def test_evqa_kb_needs_exactly_one_image_source(tmp_path):
    (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    with pytest.raises(ValueError, match="exactly one of --image_map, --image_dir, --image_csv"):
        convert(ConvertArgs(format="evqa-kb", input=str(tmp_path / "kb.json"), out=str(tmp_path / "kb.jsonl")))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object keyed by Wikipedia URL"):
        convert(ConvertArgs(format="evqa-kb", input=str(tmp_path / "list.json"), image_dir=str(tmp_path),
                            out=str(tmp_path / "kb.jsonl")))
    assert not (tmp_path / "kb.jsonl").exists() and not store_path_for(tmp_path / "kb.jsonl").exists()


def wiki6m_rows():
    real = list(read_jsonl(REAL / "wiki6m_sample.jsonl"))  # wikipedia_image_url is null there
    return real + [
        {"wikidata_id": "Q243", "wikipedia_title": "Eiffel Tower", "wikipedia_summary": "A tower in Paris.",
         "wikipedia_content": "A tower in Paris. It was built in 1889.", "wikipedia_image_url": "http://img/eiffel.jpg"},
        {"wikidata_id": "Q90", "wikipedia_title": "Paris", "wikipedia_summary": "Capital of France.",
         "wikipedia_content": "Capital of France. Big.", "wikipedia_image_url": None},
    ]


def write_wiki6m(tmp_path):
    (tmp_path / "Wiki6M_ver_1_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in wiki6m_rows()))
    root = tmp_path / "wikipedia_images_full"
    (root / "Q90").mkdir(parents=True)
    (root / "Q90" / "Q90.jpg").write_bytes(b"x")  # UniIR's <QID[:4]>/<QID>.jpg layout
    folder = image_folder(tmp_path, ["http://img/eiffel.jpg"])
    return root, folder


def test_wiki6m_kb_keys_entities_by_qid(tmp_path):
    root, folder = write_wiki6m(tmp_path)
    n = convert(ConvertArgs(format="wiki6m", input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"), images_root=str(root),
                            image_dir=str(folder), out=str(tmp_path / "kb.jsonl")), log=quiet)
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
    rows = [{"data_id": "infoseek_val_00000001", "image_id": "oven_05050169", "question": "Which city is this in?",
             "answer": ["Paris"], "answer_eval": ["Paris"], "data_split": "val_unseen_entity"},
            {"data_id": "infoseek_val_00000002", "image_id": "oven_05050170", "question": "Built when?",
             "answer": ["1889"], "answer_eval": [{"wikidata": 1889.0, "range": [1888.0, 1890.0]}],
             "data_split": "val_unseen_question"},
            {"data_id": "infoseek_val_00000003", "image_id": "oven_05050171", "question": "Who?",
             "answer": ["x"], "answer_eval": ["x"], "data_split": "val_unseen_question"}]
    withkb = [{"data_id": "infoseek_val_00000002", "entity_id": "Q243", "entity_text": "Eiffel Tower"},
              {"data_id": "infoseek_val_00000001", "entity_id": "Q90", "entity_text": "Paris"},  # another order
              {"data_id": "infoseek_val_00000003", "entity_id": "Q3", "entity_text": "Not in any KB"}]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val_withkb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in withkb))


def test_infoseek_questions_meet_a_wiki6m_kb_and_a_url_kb_through_the_qid_map(tmp_path):
    root, folder = write_wiki6m(tmp_path)
    infoseek_question_files(tmp_path)
    convert(ConvertArgs(format="wiki6m", input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"), images_root=str(root),
                        image_dir=str(folder), out=str(tmp_path / "wiki6m_kb.jsonl")), log=quiet)
    q = dict(format="infoseek", input=str(tmp_path / "val.jsonl"), withkb=str(tmp_path / "val_withkb.jsonl"))
    # 1. QID questions against the QID-keyed Wiki6M KB: gold entities resolve directly
    convert(ConvertArgs(**q, kb=str(tmp_path / "wiki6m_kb.jsonl"), out=str(tmp_path / "q_qid.jsonl")), log=quiet)
    assert [a["entity_id"] for a in read_jsonl(tmp_path / "q_qid.jsonl.absent.jsonl")] == [["Q3"]]
    # 2. against a URL-keyed KB (EchoSight's format, spelled http:// and with %-escapes) through a QID → URL map
    url_kb = {"http://en.wikipedia.org/wiki/Eiffel%20Tower": {**EVQA_KB[ZORVAK], "url": "http://en.wikipedia.org/wiki/Eiffel%20Tower",
                                                                "title": "Eiffel Tower"},
              "https://en.wikipedia.org/wiki/Paris": {**EVQA_KB[ZORVAK], "url": "https://en.wikipedia.org/wiki/Paris",
                                                       "title": "Paris"}}
    (tmp_path / "url_kb.json").write_text(json.dumps(url_kb))
    folder2 = image_folder(tmp_path, ["http://img/a.jpg"])
    convert(ConvertArgs(format="evqa-kb", input=str(tmp_path / "url_kb.json"), image_dir=str(folder2),
                        out=str(tmp_path / "url_kb.jsonl")), log=quiet)
    convert(ConvertArgs(format="qid-map", input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"), out=str(tmp_path / "qid2url.tsv")),
            log=quiet)
    for kb in ("url_kb.jsonl", "url_kb.articles.sqlite"):  # the KB JSONL or its article store
        out = tmp_path / f"q_url_{kb}.jsonl"
        convert(ConvertArgs(**q, entity_map=str(tmp_path / "qid2url.tsv"), kb=str(tmp_path / kb), out=str(out)),
                log=quiet)
        got = {r["id"]: r["entity_id"] for r in read_jsonl(out)}
        assert got == {"infoseek_val_00000001": "https://en.wikipedia.org/wiki/Paris",
                       "infoseek_val_00000002": "http://en.wikipedia.org/wiki/Eiffel%20Tower",  # the KB's own key
                       "infoseek_val_00000003": "Q3"}  # unmapped: unchanged, and reported absent
        assert [a["id"] for a in read_jsonl(f"{out}.absent.jsonl")] == ["infoseek_val_00000003"]


def test_kb_check_reports_nothing_when_every_gold_entity_is_there(tmp_path, capsys):
    root, folder = write_wiki6m(tmp_path)
    infoseek_question_files(tmp_path)
    convert(ConvertArgs(format="wiki6m", input=str(tmp_path / "Wiki6M_ver_1_0.jsonl"), images_root=str(root),
                        image_dir=str(folder), out=str(tmp_path / "kb.jsonl")), log=quiet)
    rows = [r for r in read_jsonl(tmp_path / "val.jsonl") if r["data_id"] != "infoseek_val_00000003"]
    (tmp_path / "val2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    convert(ConvertArgs(format="infoseek", input=str(tmp_path / "val2.jsonl"), withkb=str(tmp_path / "val_withkb.jsonl"),
                        kb=str(tmp_path / "kb.jsonl"), out=str(tmp_path / "q.jsonl")), log=quiet)
    assert "0 of 2 questions have a gold entity the KB has no row for" in capsys.readouterr().out
    assert not (tmp_path / "q.jsonl.absent.jsonl").exists()


def test_toy_kb_goes_through_the_store_unchanged(tmp_path, tiny_world):
    toy_world = tiny_world
    kb = list(read_jsonl(toy_world / "kb.jsonl"))
    n = convert(ConvertArgs(format="articles", input=str(toy_world / "kb.jsonl"), out=str(tmp_path / "a.sqlite")),
                log=quiet)
    store = ArticleStore(tmp_path / "a.sqlite")
    assert n == len(kb) and len(store) == len({r["entity_id"] for r in kb})
    for r in kb:
        e = store.entry(r["entry_id"])
        assert {k: e[k] for k in r} == r
    some = kb[0]["entity_id"]
    texts = {r["text"] for r in kb if r["entity_id"] == some}
    assert {s["text"] for s in store.sections(some)} == texts and len(store.sections(some)) == len(texts)
    assert store_path_for(toy_world / "kb.jsonl").is_file()  # the toy world writes its store itself


def test_store_refuses_interleaved_entities_and_leaves_nothing(tmp_path):
    rows = [dict(entry_id=f"e{i}", entity_id=ent, title=ent, section_title="s", text="t", image="x.png")
            for i, ent in enumerate(["A", "B", "A"])]
    with pytest.raises(ValueError, match="not contiguous"):
        store_from_kb_rows(rows, tmp_path / "a.sqlite")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="does not exist"):
        ArticleStore(tmp_path / "a.sqlite")


@given(st.text(alphabet="abcdefghij _()", min_size=1, max_size=20))
def test_canonical_url_ignores_scheme_escapes_and_spaces(title):
    import urllib.parse

    url = wiki6m_url(title)
    variants = [url, url.replace("https://", "http://"), "http://en.wikipedia.org/wiki/" + urllib.parse.quote(title),
                url.replace("en.wikipedia", "en.m.wikipedia")]
    assert len({canonical_url(v) for v in variants}) == 1


def test_qid_map_from_echosight_csv_joined_with_withkb(tmp_path):
    with open(tmp_path / "infoseek_test.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["data_id", "wikipedia_url", "question_type"])
        w.writeheader()
        w.writerow({"data_id": "infoseek_val_1", "wikipedia_url": "https://en.wikipedia.org/wiki/Paris",
                    "question_type": "infoseek"})
        w.writerow({"data_id": "infoseek_val_2", "wikipedia_url": "https://en.wikipedia.org/wiki/Paris",
                    "question_type": "infoseek"})  # same entity again: once
        w.writerow({"data_id": "infoseek_val_9", "wikipedia_url": "https://en.wikipedia.org/wiki/Nowhere",
                    "question_type": "infoseek"})  # no withkb row: no pair
    (tmp_path / "withkb.jsonl").write_text(
        '{"data_id": "infoseek_val_2", "entity_id": "Q90", "entity_text": "Paris"}\n'
        '{"data_id": "infoseek_val_1", "entity_id": "Q90", "entity_text": "Paris"}\n')
    n = convert(ConvertArgs(format="qid-map", input=str(tmp_path / "infoseek_test.csv"),
                            withkb=str(tmp_path / "withkb.jsonl"), out=str(tmp_path / "m.tsv")), log=quiet)
    assert n == 1 and (tmp_path / "m.tsv").read_text() == "Q90\thttps://en.wikipedia.org/wiki/Paris\n"
    with pytest.raises(ValueError, match="--withkb"):
        convert(ConvertArgs(format="qid-map", input=str(tmp_path / "infoseek_test.csv"), out=str(tmp_path / "x.tsv")))


def test_fetch_images_names_files_by_url_hash_resumes_and_lists_failures(tmp_path):
    import functools
    import http.server
    import threading

    from retrieval.fetch_images import FetchArgs, fetch_images, file_name

    site = tmp_path / "site"
    site.mkdir()
    (site / "a.jpg").write_bytes(b"\xff\xd8 jpeg bytes")
    (site / "b.png").write_bytes(b"\x89PNG bytes")
    (site / "page.html").write_text("<html></html>")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        urls = [f"{base}/a.jpg", f"{base}/b.png", f"{base}/gone.jpg", f"{base}/page.html"]
        kb = {ZORVAK: {**EVQA_KB[ZORVAK], "image_urls": urls + [f"{base}/a.jpg"]}}  # a repeated URL: once
        (tmp_path / "kb.json").write_text(json.dumps(kb))
        args = FetchArgs(kb=str(tmp_path / "kb.json"), out=str(tmp_path / "imgs"), workers=2, timeout=5)
        first = fetch_images(args, log=quiet)
        assert first == {"fetched": 2, "failed": 2, "already there": 0}
        assert (tmp_path / "imgs" / file_name(urls[0])).read_bytes() == b"\xff\xd8 jpeg bytes"
        assert file_name(urls[1]) == f"{url_hash(urls[1])}.png"
        failed = {r["url"]: r["reason"] for r in read_jsonl(tmp_path / "imgs" / "failed.jsonl")}
        assert set(failed) == {urls[2], urls[3]} and "404" in failed[urls[2]] and "text/html" in failed[urls[3]]
        assert fetch_images(args, log=quiet) == {"fetched": 0, "failed": 0, "already there": 4}  # resumed: nothing new
        # the folder is what the KB converter's --image_dir reads
        n = convert(ConvertArgs(format="evqa-kb", input=str(tmp_path / "kb.json"), image_dir=str(tmp_path / "imgs"),
                                out=str(tmp_path / "kb.jsonl")), log=quiet)
        assert n == 3  # a.jpg twice (two image slots) and b.png
    finally:
        server.shutdown()
