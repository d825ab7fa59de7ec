"""The sharded page store: records, ordering, bounded writes, crash safety, DVC deltas."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from components.data.page_records import HARD, NOT_PREANNOTATED
from components.data.page_store import PageDataset, migrate_jsonl
from components.data.pages import LayoutElement, Page

ROOT = Path(__file__).resolve().parents[1]


def page(i: int, **meta) -> Page:
    return Page(f"p{i:05d}", "images/none.png", 32, 32, [LayoutElement("text", (0, 0, 8, 8), f"word {i}")], meta=meta)


def shard_files(store: PageDataset) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in store.shards_dir.glob("*.parquet")}


def test_records_round_trip_in_first_appearance_order(tmp_path):
    store = PageDataset(tmp_path / "s", shard_rows=4)
    store.write(page(i) for i in range(10))
    assert len(store) == 10 and len(store.shards()) == 3
    store.upsert([page(3, hard=True, consistency=0.4), page(42), page(7, preannotation={"confidence": 0.3})])
    assert store.ids() == [f"p{i:05d}" for i in (*range(10), 42)]  # an update keeps its place
    assert [p.page_id for p in store.pages()] == store.ids()
    assert store.get("p00003").meta == {"hard": True, "consistency": 0.4} and store.get("nope") is None
    assert "p00042" in store and "p00043" not in store and len(store) == 11
    assert set(store.get_many(["p00001", "missing", "p00042"])) == {"p00001", "p00042"}
    hard = [t.column("page_id").to_pylist() for t in store.scan(["page_id"], HARD)]
    assert hard == [["p00003"]]  # the old version of p3 (not hard) is dead and not returned
    assert {p.page_id for p in store.iter_pages(NOT_PREANNOTATED)} == set(store.ids()) - {"p00007"}
    assert sum(len(store.shard_pages(s)) for s in store.shards()) == 11


def test_upsert_adds_files_and_leaves_untouched_shards_byte_identical(tmp_path):
    store = PageDataset(tmp_path / "s", shard_rows=100)
    store.write(page(i) for i in range(1000))
    before = shard_files(store)
    store.upsert(page(i) for i in range(1000, 1100))
    after = shard_files(store)
    assert before.items() <= after.items() and len(after) == len(before) + 1
    assert len(store) == 1100


def test_small_upserts_and_updates_keep_the_shard_count_bounded(tmp_path):
    store = PageDataset(tmp_path / "s", shard_rows=16)
    store.write(page(i) for i in range(64))
    for i in range(64, 104):  # forty one-page upserts
        store.upsert([page(i)])
    for i in range(0, 64, 2):  # update half of the old pages, one at a time
        store.upsert([page(i, consistency=0.5)])
    shards = store.shards()
    # 72 writes, but the shards stay at most half empty (bar a short tail): <= 2 N / shard_rows + 4.
    assert len(shards) <= 2 * 104 / 16 + 4, [(s.rows, s.dead) for s in shards]
    assert all(s.dead * 2 <= s.rows for s in shards)
    assert len(store) == 104 and store.ids() == [f"p{i:05d}" for i in range(104)]
    assert store.get("p00010").meta == {"consistency": 0.5} and store.get("p00011").meta == {}


def test_the_id_index_is_rebuilt_when_missing_or_stale(tmp_path):
    store = PageDataset(tmp_path / "s", shard_rows=4)
    store.write(page(i) for i in range(6))
    store.upsert([page(2, hard=True)])
    (store.shards_dir / ".id-index.sqlite").unlink()
    assert store.get("p00002").meta == {"hard": True} and len(store.ids()) == 6
    copy = tmp_path / "copy"  # a copy made while the index was stale (e.g. a dvc checkout)
    subprocess.run(["cp", "-r", str(store.root), str(copy)], check=True)
    store.upsert([page(2, hard=False)])
    (copy / "pages" / ".id-index.sqlite").unlink()
    subprocess.run(["cp", str(store.shards_dir / ".id-index.sqlite"), str(copy / "pages")], check=True)
    assert PageDataset(copy).get("p00002").meta == {"hard": True}  # the copy's own shards decide


def test_images_are_content_addressed(tmp_path):
    store = PageDataset(tmp_path / "s")
    image = Image.new("RGB", (40, 30), "white")
    first = store.save_image("a", image)
    assert store.save_image("b", image.copy()) == first  # same bytes, same file
    assert store.store_image(image) == (first, False)
    assert store.save_image("c", Image.new("RGB", (40, 30), "black")) != first
    assert len([p for p in (store.root / "images").rglob("*.png")]) == 2


def test_a_legacy_folder_migrates_and_exports_back(tmp_path):
    folder = tmp_path / "legacy"
    folder.mkdir()
    records = [json.loads(json.dumps(page(i, seed=i).to_json())) for i in range(5)]
    (folder / "pages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(FileNotFoundError, match="migrate"):
        PageDataset(folder).pages()
    assert migrate_jsonl(folder) == 5 and not (folder / "pages.jsonl").exists()
    assert [json.loads(json.dumps(p.to_json())) for p in PageDataset(folder).pages()] == records
    assert PageDataset(folder).export_jsonl(tmp_path / "out.jsonl") == 5
    assert [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()] == records


def test_concurrent_writers_lose_nothing(tmp_path):
    store = PageDataset(tmp_path / "s", shard_rows=8)
    store.write([])

    def add(offset: int) -> None:
        for i in range(offset, offset + 20):
            PageDataset(store.root).upsert([page(i)])

    threads = [threading.Thread(target=add, args=(k * 100,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(store.ids()) == sorted(f"p{i:05d}" for k in range(3) for i in range(k * 100, k * 100 + 20))


WRITER = """
import sys
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement, Page
store = PageDataset(sys.argv[1], shard_rows=64)
batch = 0
while True:
    pages = [Page(f"b{batch}-{i}", "images/x.png", 8, 8, [LayoutElement("text", (0, 0, 1, 1), "x" * 200)],
                  meta={"consistency": 0.5, "batch": batch}) for i in range(50)]
    pages += [Page(f"b{max(0, batch - 1)}-{i}", "images/x.png", 8, 8, [], meta={"updated": batch}) for i in range(10)]
    store.upsert(pages)
    print(f"committed {batch}", flush=True)
    batch += 1
"""


def test_kill_9_during_upserts_loses_no_committed_page_and_shows_no_partial_shard(tmp_path):
    root = tmp_path / "s"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for delay in (0.9, 1.7, 2.6):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True,
                                 env=env, cwd=ROOT)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        committed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("committed")]
        assert committed, "the writer never committed; raise the delay"
        store = PageDataset(root)
        ids = set(store.ids())
        assert {f"b{b}-{i}" for b in committed for i in range(50)} <= ids
        assert len(store) == len(ids) == len(store.pages())  # every indexed row readable
        assert {s.name for s in store.shards()} <= {p.name for p in store.shards_dir.glob("*.parquet")}
    PageDataset(root).upsert([page(1)])  # the next writer clears uncommitted leftovers
    names = {p.name for p in PageDataset(root).shards_dir.glob("*.parquet")}
    assert names == {s.name for s in PageDataset(root).shards()}
    assert not list(PageDataset(root).shards_dir.glob(".part-*.tmp"))


def test_dvc_versions_only_the_new_files_when_pages_are_added(tmp_path):
    from components.data.versioning import DataVersioner

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    store = PageDataset(repo / "data" / "pages", shard_rows=50)
    pages = []
    for i in range(500):
        record = page(i)
        record.image = store.save_image(record.page_id, Image.new("L", (8, 8), i % 256))
        pages.append(record)
    store.write(pages)
    versioner = DataVersioner(repo, remote_dir=tmp_path / "remote")
    versioner.commit("500 pages", push=False)
    assert versioner.push() > 250  # 256 distinct images, 10 shards, the index, the listing
    new = page(500)
    new.image = store.save_image(new.page_id, Image.new("L", (9, 9), 7))
    store.upsert([new])
    versioner.commit("one more page", push=False)
    assert versioner.push() == 4  # its image, its shard, the new index and the folder listing
