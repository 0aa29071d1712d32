"""Tracking: the `tracking:` config section (MLflow mirroring, redaction) and reading
TensorBoard event files back.
"""
