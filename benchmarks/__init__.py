"""divtrace's benchmarks: one harness, ``python -m benchmarks SUITE [options]``.

Every figure is a ratio against the bare forward passes a user would otherwise run,
measured in one process, interleaved, as medians:

- ``floor``: every case against the bare passes and the floor (the bare passes plus
  the passes the default verdict's tests make), in one run;
- ``overhead``: time and peak memory of ``compare()`` per case and per option
  (probes, resources), optionally beside an older checkout (``--old``);
- ``sites``: models with hundreds of small sites, with the least that module hooks cost;
- ``parts``: where the time of one ``compare()`` goes, stage by stage;
- ``ops``: the ops (dispatches) of one ``compare()``, by divtrace's function that made them;
- ``lm``: language models — op sites, prompts of different lengths, generation;
- ``backward``: one backward over the batch against gradient accumulation;
- ``tables``: no figure changes — every table equal to an older checkout's.

Run ``python -m benchmarks SUITE --help`` for a suite's options.
"""
