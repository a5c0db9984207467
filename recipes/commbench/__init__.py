"""Communication benchmark recipe: collective and point-to-point bandwidth of the job's ranks.

``recipe=commbench`` runs ``bench.main``; the bandwidth arithmetic is in ``math`` (no torch), the
settings in ``settings`` and the timed operations in ``ops``. docs/commbench.md explains the columns.
"""
