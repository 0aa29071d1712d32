"""The stages: one Prefect task module per stage (or stage pair), peers that never import each other.

Each follows the stage protocol, tasks/flowkit/stage.py (skip -> build -> manifest -> publish -> event);
what two stages share lives there or in tasks/core, never in a stage module (tests/test_structure.py).
"""
