"""Launching and process control: the backend registry, torchrun on this node or on Slurm,
and teardown that reaches every process of a stage.
"""
