"""Tensor parallelism: the process group of one model replica and the collectives its layers call."""
