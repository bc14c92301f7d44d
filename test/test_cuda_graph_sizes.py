"""The decode batch sizes the engine captures CUDA graphs for (model_executor/cuda_graph_runner.py)."""

from sglang_pic.model_executor.cuda_graph_runner import capture_batch_sizes


def test_capture_sizes_reach_the_cap_whatever_it_is() -> None:
    """Every decode batch up to --cuda-graph-max-bs pads to a captured size: the cap itself is captured, past 256
    in steps of 32 (a cap of 512 once stopped at 256, leaving a quarter of a 512-request run's steps eager)."""
    for cap in (1, 3, 100, 256, 300, 512):
        sizes = capture_batch_sizes(cap)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == cap
    assert capture_batch_sizes(512)[-5:] == [384, 416, 448, 480, 512]
    assert capture_batch_sizes(256)[-3:] == [224, 240, 256]
