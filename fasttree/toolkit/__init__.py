"""The offline toolkit: profiling on a GPU, trace statistics, workload generators, timing,
measured refinement and validation of exports, and the kernel benchmark (``fasttree-tune bench``).
Nothing here is imported by the serving path (:mod:`fasttree`'s planner, kernels and runtime)."""
