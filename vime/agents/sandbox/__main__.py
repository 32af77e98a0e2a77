"""`python -m vime.agents.sandbox`: the sandbox service (`vime.agents.sandbox.service.main`)."""

from vime.agents.sandbox.service import main

main()
