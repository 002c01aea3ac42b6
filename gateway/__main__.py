"""`python -m gateway`: run the OpenAI-compatible HTTP gateway."""

from gateway.server import main

main()
