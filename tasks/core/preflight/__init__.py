"""Pre-flight: every check a run can fail in seconds, the report, the storage and
model-metadata checks, before a model is loaded or a rank started.
"""
