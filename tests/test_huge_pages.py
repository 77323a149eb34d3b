"""engine.huge_pages: the loaded weights moved into one huge-page-advised mapping, values and ties unchanged,
generation identical; nothing moved where THP is off or the user turned it off."""
import re

import pytest
import torch

import engine.huge_pages as huge_pages
from engine import LLM, SamplingParams
from tests.model_utils import save_tiny, tiny_hf_model


def _regions_advised_huge() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings with the hg (MADV_HUGEPAGE) flag, from /proc/self/smaps."""
    out, cur = [], None
    for line in open("/proc/self/smaps"):
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            cur = (int(m.group(1), 16), int(m.group(2), 16))
        elif line.startswith("VmFlags:") and " hg" in line and cur:
            out.append(cur)
    return out


def _resident_kb(ptr: int) -> int:
    """Rss of the mapping holding ``ptr`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the pointer")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("huge")
    save_tiny(tiny_hf_model("llama"), path)
    return str(path)


def test_weights_move_with_values_and_ties_kept():
    emb = torch.nn.Embedding(300, 64)
    model = torch.nn.Sequential(emb, torch.nn.Linear(64, 300, bias=False), torch.nn.LayerNorm(64))
    model[1].weight = emb.weight                            # tied: one tensor
    model.register_buffer("table", torch.arange(5000, dtype=torch.int16))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    if not huge_pages.available():
        assert huge_pages.move_weights(model, min_bytes=4096) == 0
        pytest.skip("transparent huge pages are off here")
    moved = huge_pages.move_weights(model, min_bytes=4096)
    assert moved == 300 * 64 * 4 + 5000 * 2                   # the tied weight once, the small norm left alone
    assert model[1].weight is emb.weight
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    regions = _regions_advised_huge()
    for t in (emb.weight, model.table):
        assert t.data_ptr() % 64 == 0
        assert any(a <= t.data_ptr() < b for a, b in regions), "not in a MADV_HUGEPAGE mapping"
    assert not any(a <= model[2].weight.data_ptr() < b for a, b in regions)


def test_nothing_moves_when_turned_off(monkeypatch):
    model = torch.nn.Linear(512, 512)
    monkeypatch.setenv("BATCHGEN_HUGE_PAGES", "0")
    ptr = model.weight.data_ptr()
    assert not huge_pages.available() and huge_pages.move_weights(model, min_bytes=1) == 0
    assert model.weight.data_ptr() == ptr


def test_generation_identical_with_and_without(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1024)
    real, moved_bytes = huge_pages.move_weights, []
    monkeypatch.setattr(huge_pages, "move_weights", lambda m: moved_bytes.append(real(m)) or moved_bytes[-1])
    prompts = [[1, 5, 9, 40, 41, 42, 7], [1, 3, 3, 3, 100, 200]]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    moved = [o.token_ids for o in LLM(tiny_dir, dtype="float32", quantization="int8").generate(prompts, sp)]
    monkeypatch.setenv("BATCHGEN_HUGE_PAGES", "0")
    kept = [o.token_ids for o in LLM(tiny_dir, dtype="float32", quantization="int8").generate(prompts, sp)]
    assert moved == kept
    assert moved_bytes[0] > 0 or not huge_pages.available()
    assert moved_bytes[1] == 0                                # turned off


def test_pages_of_a_mapped_file_dropped_and_read_back(tmp_path):
    """The copied weights' old pages in a mapped file are dropped from the process (not resident), and still read
    back as the file's bytes if touched; anonymous memory is left alone."""
    import mmap as mm
    data = torch.arange(1 << 20, dtype=torch.int32)
    (tmp_path / "w.bin").write_bytes(data.numpy().tobytes())
    with open(tmp_path / "w.bin", "rb") as f:
        m = mm.mmap(f.fileno(), 0, flags=mm.MAP_PRIVATE, prot=mm.PROT_READ | mm.PROT_WRITE)
    t = torch.frombuffer(m, dtype=torch.int32)
    assert int(t.sum()) == int(data.sum()) and _resident_kb(t.data_ptr()) >= 4096      # paged in
    anon = torch.arange(1 << 20, dtype=torch.int32)
    huge_pages._drop_file_pages([(t.data_ptr(), 4 << 20), (anon.data_ptr(), 4 << 20)])
    assert torch.equal(anon, data)
    assert _resident_kb(t.data_ptr()) == 0                   # none of its pages in this process now
    assert torch.equal(t, data)                               # read back from the file
