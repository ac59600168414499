"""The scripts that made the GPU results in ``docs/results/`` (``h200/``, ``h200x2/``):
each is run as ``python benchmarks/gpu/NAME_gpu.py --out docs/results/h200`` on the
machine it names, and ``docs/results/README.md`` says which files each one wrote."""
