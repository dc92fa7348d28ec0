"""The benchmark runs end to end in its CI-sized form. Timings are printed, never asserted;
on the CPU every timed call is also checked against the torch reference."""

from __future__ import annotations

import kvcore
from kernels.attention import bench as bench_attention


def test_bench_runs_small_on_cpu(capsys):
    bench_attention.main(["--device", "cpu", "--small"])
    lines = capsys.readouterr().out.splitlines()
    decode_rows = [line for line in lines if line.split()[-1:] and line.endswith("%")]
    for layout in kvcore.valid_layout_names():
        # decode: 2 block sizes x 1 batch x 2 contexts; prefill: 2 block sizes
        assert sum(f"  {layout}  " in line for line in decode_rows) == 4
        assert sum(f"  {layout}  " in line and line.endswith("x") for line in lines) == 2
    assert lines[-1] == "done on cpu"
