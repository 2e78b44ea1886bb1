"""The README's main job runs end to end."""

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
    assert "[0.5, 2.5, 4.5, 6.5]" in out
    assert "linear at head         rel. error vs float = 0.00e+00" in out
    assert "linear at decoder/mlp  rel. error vs float = 0.00e+00" not in out
