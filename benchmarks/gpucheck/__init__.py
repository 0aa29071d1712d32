"""benchmarks/gpu_check.py's parts: `steps` (bookkeeping, subprocesses, records), `subcommands` (what
runs in each subprocess), `runs` (the steps), `verdicts` (the checks on the flows' records, the summary).

    python benchmarks/gpu_check.py --smoke
"""
