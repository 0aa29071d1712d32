"""Configuration: the run config schema (a leaf), its loader, and the rules a config must obey.
Registries of plugins and parallel-layout rules live here; overrides and project-relative paths too.
"""
