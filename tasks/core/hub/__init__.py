"""The Hugging Face Hub: repo-id rules, where the token comes from, and the model card that goes with
a push.

- card.py  the model card (README.md) of an export, from recorded facts only
- repo.py  Hub helpers shared by load, push and pre-flight
"""
