"""``python -m jetbatch``: the ``jetbatch`` command."""

import os
import signal

# Ctrl-C while the command's own modules import: exit 130 quietly, as main() does from its start.
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))

from jetbatch.sidecar.cli import main  # after the handler, which covers this import

raise SystemExit(main())
