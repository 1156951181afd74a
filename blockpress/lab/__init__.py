"""The measurement lab: what the benchmarks and `blockpress bench` use to time, profile and account for a model.

- bench.py: the benchmark harness (blockpress vs transformers vs the AR decode; tokens/s, ms per step, roofline);
- presets.py: model sizes built with random weights; random_weights.py: those weights, made on the device;
- roofline.py: bytes and floors of a pass; profile.py: where a step's time goes, by kernel class;
- memory.py: peak memory accounted on the meta device; aot.py: Triton kernels compiled ahead of time for a GPU
  this machine does not have (instruction counts, register and shared-memory use).
Nothing in the engine, the model or the kernels imports this package.
"""
