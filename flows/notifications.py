"""Apply the failure-notification automation (deployments/automations.yaml) to a Prefect server.

    cpt-to-sft notifications --webhook-url "$WEBHOOK_URL"     # saves the block too
    cpt-to-sft notifications --block slack-webhook/ml-alerts                 # an existing block
    python -m flows.notifications --webhook-url URL                          # the same, from a checkout

The server is the one in PREFECT_API_URL. `--webhook-url` saves a Custom Webhook notification block
(default name `cpt-to-sft-failures`) that POSTs JSON `{"subject", "body", "text"}`; `--block`
uses an existing notification block of any type (`<type slug>/<name>`, or a Custom Webhook
block's name). The automation file's BLOCK_DOCUMENT_ID is replaced by that block's id, and an
automation of the same name is replaced, so applying twice leaves one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from uuid import UUID

import yaml

from tasks.core.config.paths import resolve_local

AUTOMATIONS = "deployments/automations.yaml"
PLACEHOLDER = "BLOCK_DOCUMENT_ID"
DEFAULT_BLOCK = "cpt-to-sft-failures"
WEBHOOK_SLUG = "custom-webhook"
# What the webhook receives; {{subject}}/{{body}} are the automation's rendered templates.
WEBHOOK_JSON = {"subject": "{{subject}}", "body": "{{body}}", "text": "{{subject}}\n{{body}}"}


def save_webhook(url: str, name: str = DEFAULT_BLOCK) -> UUID:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    return CustomWebhookNotificationBlock(name="cpt-to-sft", url=url, json_data=WEBHOOK_JSON).save(name, overwrite=True)


def block_id(ref: str) -> UUID:
    """The document id of a saved notification block: `<type slug>/<name>` or a Custom Webhook name."""
    from prefect.blocks.core import Block

    block = Block.load(ref if "/" in ref else f"{WEBHOOK_SLUG}/{ref}")
    return block._block_document_id


def apply(block_document_id: UUID, path: str | Path = AUTOMATIONS) -> dict[str, UUID]:
    """Create every automation of the file (replacing same-named ones); {name: id}."""
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    text = Path(resolve_local(str(path))).read_text().replace(PLACEHOLDER, str(block_document_id))
    created: dict[str, UUID] = {}
    with get_client(sync_client=True) as client:
        for entry in yaml.safe_load(text)["automations"]:
            automation = AutomationCore.model_validate(entry)
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            created[automation.name] = client.create_automation(automation)
    return created


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpt-to-sft notifications", description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--webhook-url", help="save a Custom Webhook block (named --block-name) posting to this URL and use it"
    )
    which.add_argument(
        "--block", help="use this existing notification block: '<type slug>/<name>' or a Custom Webhook block name"
    )
    p.add_argument(
        "--block-name", default=DEFAULT_BLOCK, help=f"name of the block --webhook-url saves (default {DEFAULT_BLOCK})"
    )
    p.add_argument("--file", default=AUTOMATIONS, help=f"the automation definitions (default {AUTOMATIONS})")
    args = p.parse_args(argv)
    bid = save_webhook(args.webhook_url, args.block_name) if args.webhook_url else block_id(args.block)
    for name, aid in apply(bid, args.file).items():
        print(f"automation {name}: {aid} (notification block {bid})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
