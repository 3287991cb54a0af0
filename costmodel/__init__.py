"""Learned latency model of fasttree plans (installed as ``fasttree.costmodel``; needs scikit-learn).

Modules, each with one job:

* :mod:`~fasttree.costmodel.gpu` -- GPU facts (:class:`GpuSpec`) by the name traces record.
* :mod:`~fasttree.costmodel.work` -- what a plan's launches do (programs, rows, tokens, bytes, flops).
* :mod:`~fasttree.costmodel.simulator` -- the analytic GPU simulator (occupancy, list scheduling).
* :mod:`~fasttree.costmodel.features` -- the feature row of a plan (work, GPU facts, simulator).
* :mod:`~fasttree.costmodel.dataset` -- measurement traces -> feature matrix, tree ids, families.
* :mod:`~fasttree.costmodel.model` -- :class:`LatencyModel`, the scikit-learn estimator.
* :mod:`~fasttree.costmodel.predict` -- batched prediction of many plans or planning jobs (worker processes).
* :mod:`~fasttree.costmodel.persist` -- model files (skops archives, no pickle); :mod:`~fasttree.costmodel.regressors`
  checks a loaded regressor, :mod:`~fasttree.costmodel.legacy` reads older JSON model files for conversion.
* :mod:`~fasttree.costmodel.metrics` / :mod:`~fasttree.costmodel.evaluate` -- held-out metrics and protocols.

The command line is ``fasttree-tune fit`` / ``fasttree-tune evaluate``.
"""
