"""The run and its artifacts: stage list and run-root layout, manifests, digests, the job file,
the rank<->task line protocol, the run-root lease, and a process's host-memory peak (HostPeak).
"""
