"""``python -m jetbatch``: the ``jetbatch`` command."""

from jetbatch.sidecar.cli import main

raise SystemExit(main())
