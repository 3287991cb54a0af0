"""Learned latency model of fasttree plans (installed as ``fasttree.costmodel``).

Not implemented yet: issue 5 (simulator-backed learned latency model) builds it.
"""
