"""Moving streamed weights into transparent huge pages behind a running engine (artifact/huge_pages.py)."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.artifact import huge_pages
from edgellm.artifact.huge_pages import HUGE_PAGE, HugePageMover, batches, mapping_bounds, windows
from edgellm.artifact.tensors import map_shard
from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams
from edgellm.runtime.engine import HUGE_PAGES_ENV, Engine

needs_movable = pytest.mark.skipif(huge_pages.unavailable_reason() is not None,
                                   reason=f"weights stay mapped here: {huge_pages.unavailable_reason()}")


# ---------------------------------------------------------------------------------------- which windows
def _windows_by_bytes(tensors: list[tuple[int, int]], mappings: list[tuple[int, int]]) -> list[int]:
    """The reference: every 2 MiB window, kept when it holds a tensor byte and lies inside that tensor's mapping."""
    lo = min(a for a, _ in mappings) // HUGE_PAGE * HUGE_PAGE
    hi = max(b for _, b in mappings)
    kept = []
    for w in range(lo, hi, HUGE_PAGE):
        for address, n in tensors:
            home = [m for m in mappings if m[0] <= address and address + n <= m[1]]
            if n > 0 and home and address < w + HUGE_PAGE and w < address + n and home[0][0] <= w \
                    and w + HUGE_PAGE <= home[0][1]:
                kept.append(w)
                break
    return kept


def test_windows_are_whole_2mib_windows_of_tensors_inside_their_mapping() -> None:
    base = 1000 * HUGE_PAGE
    mappings = [(base, base + 9 * HUGE_PAGE), (base + 10 * HUGE_PAGE + 4096, base + 14 * HUGE_PAGE + 8192)]
    rng = np.random.default_rng(7)
    for _ in range(300):
        tensors = []
        for _ in range(rng.integers(1, 6)):
            lo, hi = mappings[rng.integers(0, 2)]
            start = int(rng.integers(lo - HUGE_PAGE, hi))  # some start outside any mapping
            tensors.append((start, int(rng.integers(0, 3 * HUGE_PAGE))))
        assert windows(tensors, mappings) == _windows_by_bytes(tensors, mappings)


def test_a_window_crossing_the_mapping_edge_or_a_tensor_outside_every_mapping_is_never_moved() -> None:
    base = 50 * HUGE_PAGE
    mapping = (base + 4096, base + 3 * HUGE_PAGE)  # starts 4 KiB past a window, ends on one
    assert windows([(base + 4096, 3 * HUGE_PAGE - 4096)], [mapping]) == [base + HUGE_PAGE, base + 2 * HUGE_PAGE]
    assert windows([(base + 8 * HUGE_PAGE, HUGE_PAGE)], [mapping]) == []  # in no mapping
    assert windows([(base + 2 * HUGE_PAGE, 2 * HUGE_PAGE)], [mapping]) == []  # runs past the mapping's end
    assert windows([(base + HUGE_PAGE, 0)], [mapping]) == []


def test_adjacent_windows_are_moved_in_bounded_batches() -> None:
    w = [HUGE_PAGE * i for i in (10, 11, 12, 13, 14, 16, 17, 20)]
    assert batches(w, most=4) == [(10 * HUGE_PAGE, 4 * HUGE_PAGE), (14 * HUGE_PAGE, HUGE_PAGE),
                                  (16 * HUGE_PAGE, 2 * HUGE_PAGE), (20 * HUGE_PAGE, HUGE_PAGE)]
    assert batches([]) == []


# ---------------------------------------------------------------------------------------- moving real pages
@pytest.fixture
def shard(tmp_path: Path) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(3).integers(0, 256, size=9 * HUGE_PAGE + 12345, dtype=np.uint8)
    path = tmp_path / "weights-00001.safetensors"
    data.tofile(path)
    return path, data


def _file_backed(start: int, end: int) -> bool:
    """Whether any of [start, end) is still mapped from a file (per /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo < end and start < hi and fields[4] != "0":  # inode 0: anonymous
            return True
    return False


@needs_movable
def test_moved_weights_keep_their_address_and_bytes_and_leave_the_file(shard: tuple[Path, np.ndarray]) -> None:
    path, data = shard
    mm = map_shard(path)
    tensor = torch.frombuffer(mm, dtype=torch.uint8, count=len(data) - 5000, offset=5000)
    address = tensor.data_ptr()
    mover = HugePageMover([mm], [(tensor.data_ptr(), tensor.nbytes)]).start()
    assert mover.wait(60)
    lo, hi = mapping_bounds(mm)
    first, end = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE  # the whole windows inside
    assert mover.error is None and mover.moved_bytes == mover.total_bytes == end - first > 0
    assert tensor.data_ptr() == address
    assert np.array_equal(tensor.numpy(), data[5000:])
    assert not _file_backed(first, first + mover.total_bytes)
    assert "in huge pages" in mover.describe()


@needs_movable
def test_readers_see_the_same_bytes_while_windows_move(shard: tuple[Path, np.ndarray]) -> None:
    path, data = shard
    mm = map_shard(path)
    tensor = torch.frombuffer(mm, dtype=torch.uint8, count=len(data))
    expected = int(data.sum(dtype=np.int64))
    sums: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set() or len(sums) < 3:
            sums.append(int(tensor.sum(dtype=torch.int64)))

    reader = threading.Thread(target=read)
    reader.start()
    mover = HugePageMover([mm], [(tensor.data_ptr(), tensor.nbytes)])
    mover._runs = batches(windows([(tensor.data_ptr(), len(data))], [mapping_bounds(mm)]), most=1)  # many moves
    mover.start().wait(60)
    done.set()
    reader.join()
    assert mover.moved_bytes == mover.total_bytes > 0
    assert sums and set(sums) == {expected}


@needs_movable
def test_a_failed_move_leaves_the_bytes_mapped_and_frees_its_copy(shard: tuple[Path, np.ndarray]) -> None:
    path, data = shard
    mm = map_shard(path)
    lo, _ = mapping_bounds(mm)
    count = len(Path("/proc/self/maps").read_text().splitlines())
    with pytest.raises(OSError, match="mremap"):  # not page-aligned: mremap refuses the destination
        huge_pages._Libc().move_into_huge_pages(lo + HUGE_PAGE + 1, HUGE_PAGE)
    assert len(Path("/proc/self/maps").read_text().splitlines()) == count  # the spare copy is gone
    assert np.array_equal(np.frombuffer(mm, dtype=np.uint8), data)


def test_an_error_stops_the_mover_and_says_why(shard: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = shard
    mm = map_shard(path)
    tensor = torch.frombuffer(mm, dtype=torch.uint8, count=len(data))
    calls = []

    def refuse(self: object, address: int, length: int) -> None:
        calls.append(address)
        if len(calls) > 1:
            raise OSError(12, "mmap of 10485760 bytes: Cannot allocate memory")

    monkeypatch.setattr(huge_pages._Libc, "move_into_huge_pages", refuse)
    monkeypatch.setattr(huge_pages, "unavailable_reason", lambda: None)
    mover = HugePageMover([mm], [(tensor.data_ptr(), tensor.nbytes)])
    mover._runs = batches(windows([(tensor.data_ptr(), len(data))], [mapping_bounds(mm)]), most=1)
    mover.start().wait(60)
    assert len(calls) == 2 and mover.moved_bytes == HUGE_PAGE < mover.total_bytes
    assert mover.describe() == f"mapped ([Errno 12] mmap of 10485760 bytes: Cannot allocate memory; 2 of " \
                               f"{mover.total_bytes / 2**20:.0f} MiB moved)"
    assert np.array_equal(tensor.numpy(), data)


def test_stop_ends_the_mover_between_batches(shard: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = shard
    mm = map_shard(path)
    tensor = torch.frombuffer(mm, dtype=torch.uint8, count=len(data))
    entered, release = threading.Event(), threading.Event()

    def slow(self: object, address: int, length: int) -> None:
        entered.set()
        release.wait(10)

    monkeypatch.setattr(huge_pages._Libc, "move_into_huge_pages", slow)
    monkeypatch.setattr(huge_pages, "unavailable_reason", lambda: None)
    mover = HugePageMover([mm], [(tensor.data_ptr(), tensor.nbytes)])
    mover._runs = batches(windows([(tensor.data_ptr(), len(data))], [mapping_bounds(mm)]), most=1)
    mover.start()
    assert entered.wait(10)
    assert "moving into huge pages" in mover.describe()
    threading.Timer(0.2, release.set).start()
    mover.stop()
    assert mover.moved_bytes == HUGE_PAGE < mover.total_bytes
    assert mover.describe().endswith(f"of {mover.total_bytes / 2**20:.0f} MiB in huge pages, stopped "
                                     f"({mover.seconds:.2f} s in the background)")


def test_unavailable_or_off_leaves_everything_mapped(shard: tuple[Path, np.ndarray],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = shard
    mm = map_shard(path)
    tensor = torch.frombuffer(mm, dtype=torch.uint8, count=len(data))
    monkeypatch.setattr(huge_pages, "unavailable_reason", lambda: "needs Linux's mremap, not darwin")
    mover = HugePageMover([mm], [(tensor.data_ptr(), tensor.nbytes)]).start()
    assert mover.wait(0) and mover.moved_bytes == 0
    assert mover.describe() == "mapped (needs Linux's mremap, not darwin)"
    assert HugePageMover([mm], [(tensor.data_ptr(), tensor.nbytes)], off="torch decode path").start().describe() == "mapped (torch decode path)"
    assert HugePageMover([mm], []).start().describe() in ("mapped (no 2 MiB window to move)",
                                                          "mapped (needs Linux's mremap, not darwin)")


# ---------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def smollm2_mapped() -> Engine:
    return Engine.load("smollm2-135m", quantization="q4f16_1", progress=False, threads=1, huge_pages="off")


def test_engine_decodes_the_same_tokens_with_its_weights_in_huge_pages(smollm2_mapped: Engine) -> None:
    params = GenerationParams(max_tokens=24, temperature=0.0)
    moved = Engine.load("smollm2-135m", quantization="q4f16_1", progress=False, threads=1, huge_pages="wait")
    try:
        assert smollm2_mapped.huge_pages.describe() == f"mapped ({HUGE_PAGES_ENV}=off)"
        if huge_pages.unavailable_reason() is None:
            # every streamed matrix of SmolLM2 (tied embedding = LM head) sits in 2 MiB windows but for shard edges
            streamed = sum(n for _, n in moved.model.streamed_spans())
            assert 0.8 * streamed < moved.huge_pages.moved_bytes == moved.huge_pages.total_bytes <= streamed + 2**24
        ids = smollm2_mapped.encode("The three primary colours are")
        assert moved.generate(ids, params).token_ids == smollm2_mapped.generate(ids, params).token_ids
    finally:
        moved.close()


def test_engine_takes_its_default_from_the_environment_and_refuses_a_bad_value(
        smollm2_mapped: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HUGE_PAGES_ENV, "sometimes")
    with pytest.raises(EdgeLLMError, match="huge pages 'sometimes': choose one of background, wait, off "
                                           f"\\(from {HUGE_PAGES_ENV} when it is set\\)"):
        Engine(smollm2_mapped.artifact, threads=1)
    monkeypatch.setenv(HUGE_PAGES_ENV, "OFF")
    engine = Engine(smollm2_mapped.artifact, threads=1)
    assert engine.huge_pages.describe() == f"mapped ({HUGE_PAGES_ENV}=off)"
    engine.close()


def _mapped_shards(folder: Path) -> int:
    return sum(str(folder) in line for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.parametrize("mode", ["background", "wait", "off"])
def test_closing_an_engine_stops_its_mover_and_unmaps_the_weights(smollm2_mapped: Engine, mode: str) -> None:
    folder = smollm2_mapped.artifact.folder
    before = _mapped_shards(folder)
    engine = Engine(smollm2_mapped.artifact, threads=1, huge_pages=mode)
    assert _mapped_shards(folder) > before
    engine.close()
    assert engine.huge_pages.wait(0)
    gc.collect()
    assert _mapped_shards(folder) == before  # neither the mover nor the closed engine holds a shard mapping


def test_info_says_where_the_weights_will_be(smollm2_mapped: Engine, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from edgellm.cli import main

    def weights() -> str:
        assert main(["info", str(smollm2_mapped.artifact.folder), "--json"]) == 0
        return json.loads(capsys.readouterr().out)["weights"]

    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    reason = huge_pages.unavailable_reason()
    moving = "mapped, then the decode step's weights move into transparent huge pages"
    assert weights() == (f"{moving} in the background after load" if reason is None else f"mapped ({reason})")
    monkeypatch.setenv(HUGE_PAGES_ENV, "wait")
    assert weights() == (f"{moving} before the load returns" if reason is None else f"mapped ({reason})")
    monkeypatch.setenv(HUGE_PAGES_ENV, "off")
    assert weights() == f"mapped ({HUGE_PAGES_ENV}=off)"
    monkeypatch.setenv(HUGE_PAGES_ENV, "1")
    assert main(["info", str(smollm2_mapped.artifact.folder)]) == 1
    assert capsys.readouterr().err.strip() == (f"edgellm: error: huge pages '1': choose one of background, wait, off "
                                               f"(from {HUGE_PAGES_ENV} when it is set)")


def test_weights_stay_mapped_when_free_memory_would_not_leave_room(smollm2_mapped: Engine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from edgellm.runtime import engine as engine_module

    streamed = sum(n for _, n in smollm2_mapped.model.streamed_spans())
    room = streamed + engine_module.HUGE_PAGES_HEADROOM
    monkeypatch.setattr(engine_module, "available_memory", lambda: (room - 1, "cgroup limit"))
    tight = Engine(smollm2_mapped.artifact, threads=1, huge_pages="wait")
    assert tight.huge_pages.describe() == (f"mapped ({(room - 1) / 2**20:.0f} MiB free (cgroup limit): weights stay "
                                           "in the reclaimable page cache)")
    assert tight.huge_pages.moved_bytes == 0
    monkeypatch.setattr(engine_module, "available_memory", lambda: (room, "MemAvailable"))
    roomy = Engine(smollm2_mapped.artifact, threads=1, huge_pages="wait")
    assert roomy.huge_pages.describe().startswith("mapped (" if huge_pages.unavailable_reason() else "76 of 76 MiB")
    tight.close()
    roomy.close()
