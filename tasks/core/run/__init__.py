"""The run and its artifacts: stage list and run-root layout, manifests, digests, the job file,
the rank<->task line protocol, and the run-root lease.
"""
