"""`python -m polyspec` is the `polyspec` command."""

from polyspec.orchestrator.cli import main

raise SystemExit(main())
