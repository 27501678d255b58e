"""The recipe in docs/reproducing.md ("Reproducing the paper") run as it is written: its first commands (image
fetching, KB and question conversion) parsed out of that file and run through the modules' ``main(argv)`` on tiny
fixtures named and packed exactly as the downloads are (``encyclopedic_kb_wiki.zip``, EchoSight's
``infoseek_100k_wiki.zip`` and ``infoseek_{train,test}_filtered.csv``, OVEN's ``Wiki6M_ver_1_0.jsonl.gz`` and
``all_wikipedia_images.tar``), with a local HTTP server in Wikimedia's upload layout standing in for the network.
Also: the recipe's names and settings, the index build keeping KB images past PIL's pixel limit, and no file pointing
outside the repository."""

import csv
import gzip
import io
import json
import re
import shlex
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from common.files import read_jsonl
from retrieval.upstream.articles import ArticleStore
from retrieval.upstream.kb import url_hash
from tests.upstream_site import SVG, Site, jpeg_bytes, ok, png_bytes

REPO = Path(__file__).resolve().parents[1]
COMMAND_WORDS = ("python ", "accelerate ", "cat ", "tar ", "mkdir ", "for ", "done")


# --------------------------------------------------------------------------- the recipe, read from docs/reproducing.md


def recipe_section() -> str:
    text = (REPO / "docs/reproducing.md").read_text()
    start = text.index("## Reproducing the paper")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", recipe_section(), re.S)


def commands(block: str, alternative: bool = False) -> list[list[str]]:
    """A block's commands as argv lists in order: ``\\`` continuations joined, ``for VAR in …; do … done`` unrolled.
    With ``alternative``, the commented-out commands (``#     python -m …``) instead of the live ones."""
    lines, joined, cont = [], "", False
    for raw in block.splitlines():
        s = raw.strip()
        commented = s.startswith("#")
        if alternative:
            s = s.lstrip("#").strip()
            if not commented or not (cont or s.startswith(COMMAND_WORDS)):
                cont = False
                continue
        elif commented or not s:
            continue
        joined += s[:-1] + " " if s.endswith("\\") else s
        cont = s.endswith("\\")
        if not cont:
            lines.append(joined)
            joined = ""
    out, loop = [], None
    for line in lines:
        argv = shlex.split(line, comments=True)
        if argv[0] == "for":
            var, values = argv[1], [v.rstrip(";") for v in argv[3 : argv.index("do")]]
            loop = (var, [v for v in values if v], [])
        elif argv == ["done"]:
            var, values, body = loop
            out += [[t.replace(f"${var}", v).replace(f"${{{var}}}", v) for t in cmd] for v in values for cmd in body]
            loop = None
        elif loop is not None:
            loop[2].append(argv)
        else:
            out.append(argv)
    return out


def run_recipe(cmds: list[list[str]], cwd: Path, monkeypatch) -> list[list[str]]:
    """Run the commands up to the first that needs models (the index build): returns those run."""
    from retrieval.upstream import convert, fetch_images

    monkeypatch.chdir(cwd)
    done = []
    for argv in cmds:
        argv = [str(REPO / t) if t.startswith("configs/") else t for t in argv]
        if argv[:3] == ["python", "-m", "retrieval.upstream.convert"]:
            convert.main(argv[3:])
        elif argv[:3] == ["python", "-m", "retrieval.upstream.fetch_images"]:
            fetch_images.main(argv[3:])
        elif argv[0] == "cat" and argv[-2] == ">":
            Path(argv[-1]).write_bytes(b"".join(Path(p).read_bytes() for p in argv[1:-2]))
        elif argv[:2] == ["mkdir", "-p"]:
            for p in argv[2:]:
                Path(p).mkdir(parents=True, exist_ok=True)
        elif argv[0] == "tar":
            untar(argv)
        else:
            break
        done.append(argv)
    return done


def untar(argv: list[str]) -> None:
    """``tar xf ARCHIVE -C DIR [--strip-components N]``, as GNU tar does it."""
    archive, dest = argv[argv.index("xf") + 1], Path(argv[argv.index("-C") + 1])
    strip = int(argv[argv.index("--strip-components") + 1]) if "--strip-components" in argv else 0
    assert dest.is_dir(), f"tar -C {dest}: no such folder"
    with tarfile.open(archive) as t:
        for m in t.getmembers():
            parts = Path(m.name).parts[strip:]
            if m.isfile() and parts:
                (dest / Path(*parts)).parent.mkdir(parents=True, exist_ok=True)
                (dest / Path(*parts)).write_bytes(t.extractfile(m).read())


# --------------------------------------------------------------------------- fixtures as the downloads pack them


EVQA_COLUMNS = [
    "question",
    "answer",
    "dataset_image_ids",
    "dataset_name",
    "dataset_category_id",
    "question_type",
    "wikipedia_url",
    "wikipedia_title",
    "evidence",
    "evidence_section_id",
    "evidence_section_title",
    "encyclopedic_vqa_split",
    "question_original",
    "wikipedia_url_used_in_train",
]
ZORVAK, NOPIC, ELSEWHERE = (
    "https://en.wikipedia.org/wiki/Zorvak",
    "https://en.wikipedia.org/wiki/No_picture",
    "https://en.wikipedia.org/wiki/Not_in_the_KB",
)
LANDMARK = "8b3e4a5c6d7e8f90"


def write_csv(path: Path, rows: list[dict], columns=EVQA_COLUMNS):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in columns})


def question(**kw) -> dict:
    return {
        "question": "What is it?",
        "answer": "red|crimson",
        "dataset_name": "inaturalist",
        "question_type": "templated",
        "wikipedia_url": ZORVAK,
        "wikipedia_title": "Zorvak",
        "evidence_section_id": "1.0",
        "encyclopedic_vqa_split": "test",
        "wikipedia_url_used_in_train": "False",
        **kw,
    }


def touch(path: Path, data: bytes = b"x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def zipped(path: Path, member: str, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, json.dumps(obj))


def evqa_kb(site: Site) -> dict:
    def article(url, title, sections, images):
        return {
            "title": title,
            "url": url,
            "section_titles": [t for t, _ in sections],
            "section_texts": [x for _, x in sections],
            "image_urls": images,
            "image_reference_descriptions": [""] * len(images),
            "image_section_indices": [1] * len(images),
        }

    return {
        ZORVAK: article(
            ZORVAK,
            "Zorvak",
            [("Zorvak", "A red star."), ("Habitat", "Caves."), ("Notes and references", "Smith 2001.")],
            [
                site.url("/wikipedia/commons/1/12/Zorvak.jpg"),
                site.url("/wikipedia/commons/a/ab/Flag.svg"),
                site.url("/wikipedia/commons/d/de/Dead.jpg"),
            ],
        ),
        NOPIC: article(NOPIC, "No picture", [("No picture", "A place.")], []),
    }


def evqa_downloads(root: Path, site: Site) -> None:
    raw = root / "data/evqa/raw"
    zipped(raw / "encyclopedic_kb_wiki.zip", "encyclopedic_kb_wiki.json", evqa_kb(site))
    (raw / "train_id2name.json").write_text(json.dumps({"1001": "train/00001_Animalia_x/a.jpg"}))
    (raw / "val_id2name.json").write_text(json.dumps({"2002": "val/00001_Animalia_x/b.jpg"}))
    images = root / "data/evqa/images"
    touch(images / "inaturalist/train/00001_Animalia_x/a.jpg")
    touch(images / "inaturalist/val/00001_Animalia_x/b.jpg")
    touch(images / f"landmarks/8/b/3/{LANDMARK}.jpg")
    write_csv(raw / "train.csv", [question(dataset_image_ids="1001", encyclopedic_vqa_split="train")])
    write_csv(raw / "val.csv", [question(dataset_image_ids="2002", encyclopedic_vqa_split="val")])
    write_csv(
        raw / "test.csv",
        [
            question(dataset_image_ids="2002"),
            question(
                question_type="2_hop",
                dataset_image_ids="2002",
                wikipedia_url=f"{ZORVAK}|{NOPIC}",
                evidence_section_id="1|0",
            ),
            question(
                dataset_name="landmarks",
                dataset_image_ids=LANDMARK,
                question_type="automatic",
                wikipedia_url=ELSEWHERE,
                evidence_section_id="3.0",
            ),
        ],
    )
    site.routes.update(
        {
            "/wikipedia/commons/1/12/Zorvak.jpg": [ok(jpeg_bytes(), "image/jpeg")],
            "/wikipedia/commons/thumb/a/ab/Flag.svg/960px-Flag.svg.png": [ok(png_bytes())],
            "/wikipedia/commons/a/ab/Flag.svg": [ok(SVG, "image/svg+xml")],
        }
    )


def infoseek_downloads(root: Path, site: Site) -> None:
    raw, images = root / "data/infoseek/raw", root / "data/infoseek/images"
    paris, tower = "https://en.wikipedia.org/wiki/Paris", "https://en.wikipedia.org/wiki/Eiffel_Tower"
    kb = {
        u: {
            "title": t,
            "url": u,
            "section_titles": [t],
            "section_texts": [f"{t} text."],
            "image_urls": [site.url(f"/wikipedia/commons/0/0{i}/{t}.jpg")],
            "image_reference_descriptions": [""],
            "image_section_indices": [0],
        }
        for i, (u, t) in enumerate([(paris, "Paris"), (tower, "Eiffel_Tower")])
    }
    zipped(raw / "infoseek_100k_wiki.zip", "wiki_100_dict_v4.json", kb)  # what EchoSight's zip holds
    for i, t in enumerate(["Paris", "Eiffel_Tower"]):
        site.routes[f"/wikipedia/commons/0/0{i}/{t}.jpg"] = [ok(jpeg_bytes(), "image/jpeg")]
    qs = {
        "train": [("infoseek_train_00000001", "oven_00000101", "Q90", paris)],
        "val": [
            ("infoseek_val_00000001", "oven_00000201", "Q243", tower),
            ("infoseek_val_00000002", "oven_00000202", "Q90", paris),
        ],
    }
    for split, rows in qs.items():
        lines = [
            {
                "data_id": d,
                "image_id": im,
                "question": "Which city?",
                "answer": ["Paris"],
                "answer_eval": ["Paris"],
                "data_split": "train" if split == "train" else "val_unseen_entity",
            }
            for d, im, _, _ in rows
        ]
        (raw / f"infoseek_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (raw / f"infoseek_{split}_withkb.jsonl").write_text(
            "".join(
                json.dumps({"data_id": d, "entity_id": q, "entity_text": u.rsplit("/", 1)[1]}) + "\n"
                for d, _, q, u in reversed(rows)
            )
        )
        name = "infoseek_train_filtered.csv" if split == "train" else "infoseek_test_filtered.csv"
        write_csv(
            raw / name,
            [
                question(
                    data_id=d, dataset_name="infoseek", question_type="infoseek", dataset_image_ids=im, wikipedia_url=u
                )
                for d, im, _, u in rows
            ],
            EVQA_COLUMNS + ["data_id"],
        )
        for _, im, _, _ in rows:
            touch(images / im[-8:-6] / f"{im}.jpg")
    (raw / "infoseek_val_qtype.jsonl").write_text(
        "".join(json.dumps({"data_id": d, "question_type": "String"}) + "\n" for d, _, _, _ in qs["val"])
    )
    wiki6m = [
        {
            "wikidata_id": "Q243",
            "wikipedia_title": "Eiffel Tower",
            "wikipedia_summary": "",
            "wikipedia_content": "A tower in Paris.",
            "wikipedia_image_url": site.url("/e.jpg"),
        },
        {
            "wikidata_id": "Q90",
            "wikipedia_title": "Paris",
            "wikipedia_summary": "Capital of France.",
            "wikipedia_content": "Capital of France. Big.",
            "wikipedia_image_url": None,
        },
    ]
    (raw / "Wiki6M_ver_1_0.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in wiki6m).encode()))
    with tarfile.open(raw / "all_wikipedia_images.tar", "w") as t:
        for qid in ("Q243", "Q90"):
            data = jpeg_bytes()
            info = tarfile.TarInfo(f"wikipedia_images_full/{qid[:4]}/{qid}.jpg")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    site.routes["/e.jpg"] = [ok(jpeg_bytes(), "image/jpeg")]


# --------------------------------------------------------------------------- the recipe, end to end


def test_recipe_evqa_first_steps_on_the_downloads(tmp_path, monkeypatch):
    with Site() as site:
        evqa_downloads(tmp_path, site)
        ran = run_recipe(commands(bash_blocks()[0]), tmp_path, monkeypatch)
        agents = {ua for _, ua in site.requests}
    assert [a[2] for a in ran] == ["retrieval.upstream.fetch_images", "retrieval.upstream.convert"] + [
        "retrieval.upstream.convert"
    ] * 3
    assert len(agents) == 1 and "@" in agents.pop()  # the recipe's User-Agent, with a contact
    data = tmp_path / "data/evqa"
    kb = {r["image"]: r for r in read_jsonl(data / "kb.jsonl")}
    urls = evqa_kb(site)[ZORVAK]["image_urls"]
    assert set(kb) == {f"{url_hash(urls[0])}.jpg", f"{url_hash(urls[1])}.png"}  # the SVG as its PNG rendering
    assert all(r["section_title"] == "Habitat" for r in kb.values())
    (dead,) = read_jsonl(data / "kb.jsonl.skipped.jsonl")
    assert urls[2] in dead["reason"] and [r["url"] for r in read_jsonl(data / "kb_images/failed.jsonl")] == [urls[2]]
    store = ArticleStore(data / "kb.articles.sqlite")
    assert store.counts()["articles"] == 2 and [s["text"] for s in store.sections(NOPIC)] == ["A place."]
    train, val, test = (list(read_jsonl(data / f"{s}.jsonl")) for s in ("train", "val", "test"))
    assert train[0]["image"] == "inaturalist/train/00001_Animalia_x/a.jpg" and train[0]["upstream_id"] == "E-VQA_0"
    assert val[0]["image"] == "inaturalist/val/00001_Animalia_x/b.jpg" and val[0]["id"] == "evqa-val-0"
    assert [q["id"] for q in test] == ["evqa-test-0", "evqa-test-2"]
    assert test[1]["image"] == f"landmarks/8/b/3/{LANDMARK}.jpg" and test[1]["evidence_section_id"] == 3
    (hop,) = read_jsonl(data / "test.jsonl.skipped.jsonl")
    assert hop["row"] == 1 and "2_hop" in hop["reason"]
    (absent,) = read_jsonl(data / "test.jsonl.absent.jsonl")
    assert absent == {"id": "evqa-test-2", "entity_id": [ELSEWHERE]}


def test_recipe_infoseek_first_steps_with_echosight_kb(tmp_path, monkeypatch):
    with Site() as site:
        infoseek_downloads(tmp_path, site)
        ran = run_recipe(commands(bash_blocks()[1]), tmp_path, monkeypatch)
    assert [a[2] if a[0] == "python" else a[0] for a in ran] == ["retrieval.upstream.fetch_images"] + [
        "retrieval.upstream.convert"
    ] * 3 + ["cat"] + ["retrieval.upstream.convert"] * 2
    data = tmp_path / "data/infoseek"
    assert len(list(read_jsonl(data / "kb.jsonl"))) == 2
    assert sorted(set((data / "qid2url.tsv").read_text().splitlines())) == [  # Q90 in both maps
        "Q243\thttps://en.wikipedia.org/wiki/Eiffel_Tower",
        "Q90\thttps://en.wikipedia.org/wiki/Paris",
    ]
    val = {q["id"]: q for q in read_jsonl(data / "val.jsonl")}
    assert val["infoseek_val_00000001"]["entity_id"] == "https://en.wikipedia.org/wiki/Eiffel_Tower"
    assert {q["question_type"] for q in val.values()} == {"String"} and val["infoseek_val_00000002"][
        "image"
    ] == "00/oven_00000202.jpg"
    (train,) = read_jsonl(data / "train.jsonl")
    assert train["entity_id"] == "https://en.wikipedia.org/wiki/Paris"
    assert not (data / "val.jsonl.absent.jsonl").exists() and not (data / "val.jsonl.skipped.jsonl").exists()


def test_recipe_infoseek_wiki6m_alternative(tmp_path, monkeypatch):
    alternative = commands(bash_blocks()[1], alternative=True)
    with Site() as site:
        infoseek_downloads(tmp_path, site)
        ran = run_recipe(alternative, tmp_path, monkeypatch)
    assert len(ran) == len(alternative) and any(a[:1] == ["tar"] for a in ran)
    assert any("Wiki6M_ver_1_0.jsonl.gz" in a for cmd in ran for a in cmd)
    data = tmp_path / "data/infoseek"
    rows = {r["entity_id"]: r for r in read_jsonl(data / "kb.jsonl")}
    assert rows["Q90"]["image"] == "Q90/Q90.jpg" and rows["Q243"]["text"] == "A tower in Paris."
    store = ArticleStore(data / "kb.articles.sqlite")
    assert store.entry(rows["Q243"]["entry_id"])["text"] == "A tower in Paris."


# --------------------------------------------------------------------------- the recipe's names and settings


@pytest.mark.parametrize(
    "name",
    [
        "encyclopedic_kb_wiki.zip",
        "AToMiC-Images-v0.2",  # E-VQA's KB and its pixels
        "train_full_image_cleaned.csv",  # EchoSight's cleaned train CSV
        "infoseek_100k_wiki.zip",
        "infoseek_train_filtered.csv",
        "infoseek_test_filtered.csv",  # EchoSight's InfoSeek
        "Wiki6M_ver_1_0.jsonl.gz",
        "all_wikipedia_images.tar",  # OVEN
        "https://storage.googleapis.com/gresearch/open-vision-language/infoseek/infoseek_val_qtype.jsonl",
    ],
)
def test_recipe_names_the_downloads_as_published(name):
    assert name in recipe_section()


@pytest.mark.parametrize(
    "pattern",
    [
        r"Wiki6M_ver_1_0\.jsonl(?!\.gz)",
        r"infoseek_kb_100k\.json",
        r"data/infoseek/raw/(train|test)\.csv",
        r"\.\./shared",
    ],
)
def test_recipe_has_no_name_the_downloads_do_not_use(pattern):
    assert not re.search(pattern, recipe_section())


def all_commands() -> list[list[str]]:
    return [c for b in bash_blocks() for alt in (False, True) for c in commands(b, alt)]


@pytest.mark.parametrize(
    "argv",
    [c for c in all_commands() if c[:3] == ["python", "-m", "retrieval.upstream.fetch_images"]],
    ids=lambda c: c[c.index("--kb") + 1],
)
def test_recipe_fetches_with_a_user_agent_naming_a_contact(argv):
    assert "--user_agent" in argv
    agent = argv[argv.index("--user_agent") + 1]
    assert "@" in agent or "://" in agent


@pytest.mark.parametrize("dataset,split", [("evqa", "test"), ("infoseek", "val")])  # InfoSeek's val is its test
def test_pipeline_runs_on_the_split_the_papers_report(dataset, split):
    pipeline = yaml.safe_load((REPO / f"configs/pipeline/{dataset}.yaml").read_text())
    evaluate = yaml.safe_load((REPO / f"configs/retrieval/evaluate_{dataset}.yaml").read_text())
    assert pipeline["queries"] == evaluate["queries"] == f"data/{dataset}/{split}.jsonl"


def test_no_tracked_file_outside_tests_points_at_shared():
    outside = b"../" + b"shared"  # spelled in two parts, so this test is not itself a hit for `git grep`
    try:
        files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = [
        f
        for f in files.splitlines()
        if not f.startswith("tests/") and (REPO / f).is_file() and outside in (REPO / f).read_bytes()
    ]
    assert hits == []


# --------------------------------------------------------------------------- the build keeps large KB images


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_build_keeps_kb_images_past_the_pixel_limit(tiny_world, tmp_path, monkeypatch, encoders, fmt):
    from PIL import Image

    from retrieval.build_index import BuildArgs, build_index

    kb = [json.loads(x) for x in open(tiny_world / "kb.jsonl", encoding="utf-8")][:6]
    big = tmp_path / f"big.{fmt.lower()}"
    Image.new("RGB", (300, 200), (200, 40, 40)).save(big, format=fmt)
    kb[2]["image"] = str(big)
    (tmp_path / "kb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kb))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # 60,000 pixels: past PIL's limit (10,000), like 200 MP
    m = build_index(
        BuildArgs(
            kb=str(tmp_path / "kb.jsonl"),
            images_root=str(tiny_world),
            out=str(tmp_path / "idx"),
            image_encoder="tiny",
            text_encoder="tiny",
            shard_size=4,
            workers=0,
        ),
        encoders=encoders,
        log=lambda *a: None,
    )
    assert m["rows"] == 6 and m["skipped"] == 0
