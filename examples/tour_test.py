"""The tour runs end to end."""

import contextlib
import io

from examples import tour


def test_tour_runs_and_computes():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        tour.main()
    out = buf.getvalue()
    assert "encoder/block1/conv" in out and "rule #1 (ptq): weight_qtype=int4" in out
    assert "head" in out and "disables quantization" in out
    assert "voxels" in out and "edges" in out
    sparse = next(line for line in out.splitlines() if "submanifold conv" in line)
    assert "int4 weights" in sparse
    assert 1e-3 < float(sparse.rsplit("=", 1)[1]) < 0.15  # int4 error: present, bounded
    assert "linear at head         rel. error vs float = 0.00e+00" in out
    assert "linear at decoder/mlp  rel. error vs float = 0.00e+00" not in out
