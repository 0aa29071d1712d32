"""The runbook and what runs it from a shell: the flow, its command line and the console.

- cli.py            the `cpt-to-sft` console command (run, check, verify, status, ...); `flow_main`
- console.py        the console as a view of a run: the run outlives whatever reads its output
- cpt_to_sft/       the `cpt-to-sft` Prefect flow (`python -m flows.cpt_to_sft` runs `cpt-to-sft run`)
- embedded_api.py   the embedded Prefect API server when no PREFECT_API_URL is set
- notifications.py  the failure-notification automation (deployments/automations.yaml) applied to a server
"""
