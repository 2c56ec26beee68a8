"""``python -m trainstream.bench``: the benchmarks behind the tables of README.md and docs/benchmarks.md.

Each suite measures TrainStream and its peers in the same run and writes JSON plus a
markdown table under benchmarks/results/; ``--readme`` rewrites the tables of README.md and
docs/benchmarks.md from the JSON files (bench/readme.py), so no figure is ever typed by hand.
"""
