"""`python -m flows.cpt_to_sft`: the runbook's alias of `cpt-to-sft run`; flows/cli.py parses its arguments.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml [--run-root URI] [--check]

A module of its own so that the runbook (this package's `__init__`) never imports the CLI that runs it.
"""

import sys

from flows.cli import flow_main
from flows.embedded_api import prestart

# The server's start-up (about 4 s) runs beside the rest of the CLI's work (flows/embedded_api.py).
prestart(sys.argv[1:])
sys.exit(flow_main())
