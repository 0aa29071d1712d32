"""The Hugging Face Hub: repo-id rules, where the token comes from, and the model card that goes with
a push.

- card.py      the model card (README.md) of an export, from recorded facts only
- card_data.py the card's Data section: datasets, checksums, splits, truncation, mixtures
- metadata.py  the Hub fields of a push (repo ids, license, tags) as the Hub accepts them
- outcome.py   what the card says of the run: the gate's verdict, the stop, evaluations not run
- repo.py      Hub helpers shared by load, push and pre-flight
"""
