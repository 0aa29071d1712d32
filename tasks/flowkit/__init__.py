"""What every stage is built with, on the Prefect side: the stage protocol (stage.py), pre-flight as a
task, checkpoint sinks, MLflow tracking, the UI's artifacts, stage events and the one-line console failures.
"""
