"""CUDA tensors through ``init_process_group("ferroccl")``: skipped (loudly, by pytest)
without a GPU; on a GPU machine every collective is checked against the serial reference.
"""

from __future__ import annotations

import pytest
import torch

from harness import launch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: CUDA tensors need a CUDA device")
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_tensors_match_the_serial_reference(world: int) -> None:
    for checked in launch("cuda", world).check():
        failed = [name for name, ok in checked.items() if not ok]
        assert not failed, f"differ from the reference: {failed}"
        assert len(checked) == 15
