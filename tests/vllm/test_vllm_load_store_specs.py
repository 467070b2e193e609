"""The load/store specs hand over what vLLM 0.33's do: block ids as a new ``np.int32`` array,
``group_sizes`` and ``block_indices`` as the sequences given.

vLLM's connector reads them as it reads its own (``spec.block_ids.tolist()``, ``spec.group_sizes
== [1, 1]``), so anything else fails its scheduler tests. What kvoffload adds is the checking: an
id that is negative or beyond int32 is a ``ConfigError``, and a float a ``TypeError``, where
vLLM's ``np.array(ids, dtype=np.int32)`` wraps or truncates it into some other block.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvoffload.base import GPULoadStoreSpec, make_offload_key
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.errors import ConfigError
from tests.support.procs import REPO


@pytest.mark.parametrize(
    "ids", [[31, 32, 41], (31, 32, 41), range(31, 34), np.array([31, 32, 41], dtype=np.int64)]
)
def test_block_ids_are_an_int32_array_of_the_ids_given(ids: object) -> None:
    spec = GPULoadStoreSpec(ids, group_sizes=[3], block_indices=[0])  # type: ignore[arg-type]
    assert isinstance(spec.block_ids, np.ndarray)
    assert spec.block_ids.dtype == np.int32
    assert spec.block_ids.tolist() == list(ids)  # type: ignore[call-overload]


def test_chunk_ids_are_the_same_int32_array_as_block_ids() -> None:
    spec = CPULoadStoreSpec([2, 0])
    assert spec.chunk_ids is spec.block_ids
    assert spec.chunk_ids.dtype == np.int32
    assert spec.chunk_ids.tolist() == [2, 0]


def test_group_sizes_and_block_indices_are_kept_as_given() -> None:
    sizes, starts = [2, 1], [0, 1]
    spec = GPULoadStoreSpec([31, 32, 41], group_sizes=sizes, block_indices=starts)
    assert spec.group_sizes is sizes
    assert spec.block_indices is starts
    assert spec.group_sizes == [2, 1]


def test_left_out_groups_are_one_group_starting_at_zero_as_lists() -> None:
    spec = GPULoadStoreSpec([5, 6])
    assert (spec.group_sizes, spec.block_indices) == ([2], [0])


def test_the_ids_are_copied_so_a_callers_later_change_moves_nothing() -> None:
    ids = [1, 2]
    spec = CPULoadStoreSpec(ids)
    ids[0] = 7
    assert spec.block_ids.tolist() == [1, 2]


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        ([1, -1], r"in 0\.\.2147483647, got \[-1\]"),
        ([1 << 31], r"got \[2147483648\]"),
        (np.array([1 << 40]), r"got \[1099511627776\]"),
        (np.array([[1, 2]]), "a 2-D int64 array"),
        (np.array([1.0]), "a 1-D float64 array"),
    ],
)
def test_an_id_vllm_would_wrap_or_truncate_is_refused(ids: object, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        CPULoadStoreSpec(ids)  # type: ignore[arg-type]


def test_a_float_id_in_a_list_is_refused() -> None:
    with pytest.raises(TypeError):
        CPULoadStoreSpec([1.5])  # type: ignore[list-item]


def test_group_sizes_must_cover_the_block_ids_and_give_one_start_per_group() -> None:
    with pytest.raises(ConfigError, match="sum to 2, not the 3 block ids"):
        GPULoadStoreSpec([1, 2, 3], group_sizes=[1, 1], block_indices=[0, 0])
    with pytest.raises(ConfigError, match="1 given for 2 groups"):
        GPULoadStoreSpec([1, 2, 3], group_sizes=[1, 2], block_indices=[0])


def test_specs_compare_by_identity_as_vllms_do() -> None:
    # An array has no truth value: value equality would raise where a spec is looked up.
    a, b = CPULoadStoreSpec([1, 2]), CPULoadStoreSpec([1, 2])
    assert a != b
    assert a in [b, a]
    assert [b, a].index(a) == 1
    assert len({a, b}) == 2


def test_the_cpu_manager_hands_out_int32_chunk_arrays() -> None:
    manager = CPUOffloadingManager(4)
    keys = [make_offload_key(bytes([i]), 0) for i in range(2)]
    out = manager.prepare_store(keys)
    assert out is not None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert out.store_spec.chunk_ids.dtype == np.int32
    manager.complete_store(keys)
    load = manager.prepare_load(keys[::-1])
    assert isinstance(load, CPULoadStoreSpec)
    assert load.chunk_ids.tolist() == out.store_spec.chunk_ids.tolist()[::-1]


def test_numpy_is_imported_when_a_spec_is_built_not_when_the_vocabulary_is() -> None:
    code = (
        "import sys\n"
        "import kvoffload.base, kvoffload.cpu.common\n"
        "print('numpy' in sys.modules)\n"
        "kvoffload.cpu.common.CPULoadStoreSpec([0])\n"
        "print('numpy' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, check=False
    )
    assert (done.returncode, done.stdout.split(), done.stderr) == (0, ["False", "True"], "")
