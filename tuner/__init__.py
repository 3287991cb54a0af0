"""Optuna tuner of fasttree configs (installed as ``fasttree.tuner``).

Not implemented yet: issue 6 (Optuna tuner, exported config, ``fasttree-tune``) builds it.
"""
