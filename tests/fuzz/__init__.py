"""Differential fuzzing of ``parallelize``: random single-device programs at tp=2 vs one device.

``grammar`` describes a program as plain JSON data (``programs()`` is its hypothesis
strategy, ``build(spec)`` the module); ``world`` runs specs on a persistent 2-rank
gloo world and classifies each as ``exact`` / ``named error`` / ``wrong``.
"""
