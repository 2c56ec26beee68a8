"""``python -m trainstream.bench``: the benchmarks behind the README's tables.

Each suite measures TrainStream and its peers in the same run and writes JSON plus a
markdown table under benchmarks/results/; ``--readme`` regenerates the README's tables
from those files, so no figure is ever typed by hand.
"""
