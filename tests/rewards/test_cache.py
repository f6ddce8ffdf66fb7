"""The judge cache: keyed by content, bounded in memory, kept on disk as JSON files."""

from training.rewards.cache import JudgeCache, content_key


def test_the_key_depends_on_content_not_on_key_order():
    a = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}
    b = {"temperature": 0.0, "messages": [{"content": "hi", "role": "user"}], "model": "m"}
    assert content_key(a) == content_key(b)
    assert content_key(a) != content_key({**a, "temperature": 0.5})


def test_repeated_content_hits_and_memory_is_bounded():
    cache = JudgeCache(max_entries=2)
    assert cache.get("k1") is None
    cache.put("k1", {"raw": "1"})
    cache.put("k2", {"raw": "2"})
    assert cache.get("k1") == {"raw": "1"}  # k1 is now the most recent
    cache.put("k3", {"raw": "3"})
    assert cache.get("k2") is None and cache.get("k1") == {"raw": "1"} and len(cache) == 2
    assert (cache.hits, cache.misses) == (2, 2)


def test_disk_entries_survive_a_new_cache_and_a_broken_file_is_a_miss(tmp_path):
    key = content_key({"x": 1})
    JudgeCache(cache_dir=str(tmp_path)).put(key, {"raw": "kept"})
    fresh = JudgeCache(cache_dir=str(tmp_path))
    assert fresh.get(key) == {"raw": "kept"}
    other = content_key({"x": 2})
    (tmp_path / other[:2]).mkdir(exist_ok=True)
    (tmp_path / other[:2] / f"{other}.json").write_text("{not json")
    assert fresh.get(other) is None
    assert not list(tmp_path.rglob(".tmp-*"))
